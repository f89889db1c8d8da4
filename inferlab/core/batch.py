"""What a step carries between the scheduler, the runner and the attention backend."""

from dataclasses import dataclass

import numpy as np
import torch

from inferlab.core.request import Request


@dataclass(slots=True)
class ScheduledBatch:
    """One step as the core scheduler decided it: these requests, this many new tokens each, in
    these KV blocks. A request samples a token this step when its scheduled tokens reach the end
    of what it holds; a prefill chunk that stops short computes K/V only."""

    requests: list[Request]
    num_scheduled_tokens: list[int]
    block_tables: list[list[int]]  # each request's blocks, as the KV manager holds them

    def __len__(self):
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def num_decode_tokens(self) -> int:
        """Requests computing exactly their last token (decoding); the rest of the tokens are prefill."""
        # a list's length rather than a generator's sum: read every step, and no generator resumes a row
        return len(
            [
                n
                for r, n in zip(self.requests, self.num_scheduled_tokens)
                if n == 1 and r.num_computed_tokens == len(r.token_ids) - 1
            ]
        )


@dataclass(slots=True)
class StepInputs:
    """One step's inputs on the host, packed in two buffers that go to the device in one copy:
    everything a tensor-parallel rank needs for the forward pass and the sampler's token indices,
    small enough to send to the workers each step. T new tokens of B sequences, S of which sample;
    block tables W wide."""

    # int64: input ids [T], positions [T], slot mapping [T], logits indices [S + Q], the sampling
    # sequences' lengths [S] (the index of the token each samples), then the prompt tokens the Q
    # prompt rows score [Q]
    longs: np.ndarray
    ints: np.ndarray  # int32: query start [B+1], seq lens [B], context lens [B], block tables [B*W]
    num_tokens: int  # T
    num_seqs: int  # B
    table_width: int  # W
    sample_rows: list[int]  # the sequences whose last scheduled token is sampled
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first sequences of the layout, which compute one token each
    max_decode_seq_len: int
    is_decode: bool
    has_placeholders: bool  # some input ids stand for the previous step's samples
    # Prompt tokens whose log-probabilities this step computes (requests asking for
    # prompt_logprobs): Q more rows of logits indices after the S sampling ones, and for each such
    # request (its index in the batch, the position of the first prompt token it scores, how many)
    num_prompt_rows: int = 0
    prompt_spans: tuple[tuple[int, int, int], ...] = ()


@dataclass(slots=True)
class AttentionInputs:
    """Device tensors describing a batch's layout in the paged cache, built once per step by the
    runner; each backend turns them into its own metadata. Tokens of a batch are laid out sequence
    after sequence (varlen)."""

    query_start_loc: torch.Tensor  # int32 [B+1]: where each sequence's new tokens start
    seq_lens: torch.Tensor  # int32 [B]: context length after this step (cached + new)
    context_lens: torch.Tensor  # int32 [B]: tokens already in the cache before this step
    block_tables: torch.Tensor  # int32 [B, max_blocks]: cache block ids, padded with 0 (never read past seq_lens)
    slot_mapping: torch.Tensor  # int64 [T]: cache slot (block * block_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    is_decode: bool
    block_size: int
    has_placeholders: bool = False  # some input ids stand for the previous step's samples
    # The runner lays out the sequences that compute one token each first, so that a backend can
    # attend for them as for decodes beside the prefill rows: the first num_decodes sequences
    # compute one token each (0 promises nothing), the longest of them max_decode_seq_len long.
    num_decodes: int = 0
    max_decode_seq_len: int = 0
    # A CUDA graph's static buffers (steps with prefill: see AttentionBackend.supports_prefill_graphs):
    # the tensors are padded to the graph's capacity and max_query_len is that capacity, so launch
    # grids must follow the tensors' sizes, not the contents.
    static_shapes: bool = False

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling settings of the rows that sample this step, on the logits' device.

    Noise for row i is a function of (seeds[i], steps[i]) only, so a seeded request draws the same
    tokens whatever else shares its batch, and a preempted one resumes the same stream.
    """

    temperatures: torch.Tensor  # float32 [N]; 0 = greedy
    top_k: torch.Tensor  # int64 [N]; vocab size when disabled
    top_p: torch.Tensor  # float32 [N]
    min_p: torch.Tensor  # float32 [N]
    seeds: torch.Tensor  # int64 [N]
    steps: torch.Tensor  # int64 [N]: index of the token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    adjustments: "LogitsAdjustments | None" = None  # None: no row's logits change before sampling


@dataclass(slots=True)
class LogitsAdjustments:
    """Changes to some rows' logits before temperature and filters (SamplingParams' penalties,
    logit_bias, min_tokens and grammar constraints), as flat index tensors over those R rows, so
    that a sampler applies them in a few vectorized operations. Positions in `rows` index the
    other tensors; a flat index is position * vocab + token id."""

    rows: torch.Tensor  # int64 [R]: the batch rows these concern
    presence: torch.Tensor  # float32 [R]: presence_penalty
    frequency: torch.Tensor  # float32 [R]: frequency_penalty
    repetition: torch.Tensor  # float32 [R]: repetition_penalty (1: none)
    output_tokens: torch.Tensor  # int64: flat indices of every generated token, repeated as often as generated
    prompt_tokens: torch.Tensor  # int64: flat indices of prompt tokens (repetition_penalty counts them as seen)
    bias_index: torch.Tensor  # int64: flat indices that logit_bias moves
    bias: torch.Tensor  # float32: by how much
    banned: torch.Tensor  # int64: flat indices set to -inf (EOS and stop ids before min_tokens)
    allowed_rows: torch.Tensor | None = None  # int64 [C]: positions (in `rows`) of constrained rows
    allowed: torch.Tensor | None = None  # int32 [C, ceil(vocab / 32)]: bit t % 32 of word t // 32 set if allowed
    any_penalty: bool = True  # some row has a presence, frequency or repetition penalty
