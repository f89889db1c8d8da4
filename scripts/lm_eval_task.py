"""Writes a small multiple-choice task for lm-eval into a folder (no download): 40 questions over
the embedded tiny model's corpus, each with four choices, as a jsonl file and the task's YAML.
lm-eval's local-completions then scores each choice by loglikelihood against a running server
(echo + logprobs), as docs/serving.md shows.

    python scripts/lm_eval_task.py /tmp/inferlab_mc
"""

import json
import os
import random
import sys

QUESTIONS = [
    ("The quick brown fox jumps over the", ["lazy dog", "blue sky", "old car", "green tea"], 0),
    ("A paged cache keeps keys and values in", ["blocks", "bottles", "boxes", "books"], 0),
    ("Prefix caching lets two prompts that start alike share the", ["blocks", "money", "cars", "music"], 0),
    ("Beautiful is better than", ["ugly", "pretty", "nice", "gold"], 0),
    ("Explicit is better than", ["implicit", "explicit", "simple", "fast"], 0),
    ("Simple is better than", ["complex", "simple", "hard", "soft"], 0),
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("Errors should never pass", ["silently", "loudly", "quickly", "twice"], 0),
    ("In the face of ambiguity, refuse to", ["guess", "sleep", "run", "eat"], 0),
    ("Hello,", ["world!", "moon!", "sea!", "tree!"], 0),
]


def main(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(0)
    rows = []
    for i in range(40):
        question, choices, answer = QUESTIONS[i % len(QUESTIONS)]
        order = list(range(4))
        rng.shuffle(order)
        rows.append({"question": question, "choices": [choices[j] for j in order], "answer": order.index(answer)})
    data = os.path.join(folder, "inferlab_mc.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(os.path.join(folder, "inferlab_mc.yaml"), "w") as f:
        f.write(
            "task: inferlab_mc\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            'doc_to_text: "{{question}}"\n'
            'doc_to_choice: "{{choices}}"\n'
            'doc_to_target: "{{answer}}"\n'
            'target_delimiter: " "\n'
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
        )
    print(folder)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "inferlab_mc")
