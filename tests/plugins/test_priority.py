"""The priority policy: lowest value first, FCFS among equals, and preemptive."""

from inferlab import LLM, SamplingParams

SETTINGS = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=16)
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_one_at_a_time_in_priority_order():
    with LLM(scheduler="priority", max_num_seqs=1, **SETTINGS) as llm:
        ids = [llm.add_request([5, 6, 7 + i], PARAMS, priority=p) for i, p in enumerate([3, 1, 2, 0])]
        order = []
        while not llm.is_finished():
            order += [r.priority for r in llm.step().finished]
    assert order == [0, 1, 2, 3] and sorted(ids) == ids


def test_generate_takes_priorities_and_ties_are_first_come_first_served():
    with LLM(scheduler="priority", max_num_seqs=1, **SETTINGS) as llm:
        finished = []
        real_output = llm.output

        def output(request):  # generate builds each request's output as it finishes
            finished.append(request.request_id)
            return real_output(request)

        llm.output = output
        first_id = llm.next_request_id
        outputs = llm.generate([[5, 6], [7, 8], [9, 10], [11, 12]], PARAMS, use_tqdm=False, priority=[1, 0, 1, 0])
        assert [len(o["token_ids"]) for o in outputs] == [4] * 4
        assert [f - first_id for f in finished] == [1, 3, 0, 2]  # the two of priority 0 first, each pair in order


def test_a_more_urgent_arrival_preempts_the_running_request():
    with LLM(scheduler="priority", max_num_seqs=1, **SETTINGS) as llm:
        low = llm.add_request([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), priority=5)
        llm.step()
        llm.step()
        urgent = llm.add_request([8, 9], PARAMS, priority=0)
        order = []
        while not llm.is_finished():
            order += [r.request_id for r in llm.step().finished]
        assert order == [urgent, low] and llm.stats.num_preemptions == 1
        assert llm.requests == {}


def test_fcfs_ignores_priorities():
    with LLM(max_num_seqs=1, **SETTINGS) as llm:
        for i, p in enumerate([3, 1, 2, 0]):
            llm.add_request([5, 6, 7 + i], PARAMS, priority=p)
        order = []
        while not llm.is_finished():
            order += [r.priority for r in llm.step().finished]
    assert order == [3, 1, 2, 0]
