"""Conformance tests for a sampler plugin, through its Protocol only.

    import torch
    from inferlab.testing import SamplerSuite

    class TestMySampler(SamplerSuite):
        sampler = "my_sampler"           # the name it is registered under
        sampler_options = {}              # its options, if any
        device = "cuda"                   # default "cpu"
        dtypes = (torch.bfloat16,)        # the logits' dtypes to test; default (torch.float32,)

The sampler gets logits [N, vocab] and the rows' SamplingTensors, built as the model runner builds
them, and must return N token ids (int64, on the logits' device). The suite checks that greedy rows
(temperature 0) and top_k=1 take the argmax; that draws never leave the support of top_k, top_p
and min_p; that draws follow softmax(logits / T) over that support (chi-square over thousands of
draws across seeds and steps); that a seeded row draws the same token for the same (seed, step)
whatever shares its batch, and other tokens at other steps; and mixed batches of greedy, sampled
and filtered rows. A sampler that declares supports_cuda_graphs is checked beside padding rows
and (on CUDA) replayed from a graph. A sampler that reshapes the distribution on purpose (banning
tokens, penalties) overrides expected_logits to say how. A sampler with the LogprobsSampler
capability is checked to return, with the tokens __call__ draws, the logits of the distribution
it drew from; one with LogitsProcessingSampler, to apply a logit_bias and a ban through
SamplingTensors.adjustments to the rows they name only.
"""

import math
from collections.abc import Sequence

import pytest
import torch

from inferlab.core.batch import LogitsAdjustments, SamplingTensors
from inferlab.core.config import EngineConfig
from inferlab.core.plugins import get_registry
from inferlab.core.protocols import GraphCapturableSampler, LogitsProcessingSampler, LogprobsSampler

# A distribution whose filters have wide margins (top_p and min_p thresholds sit far from any
# token's cumulative mass or probability), its tokens out of order.
PROBS = (0.07, 0.3, 0.02, 0.15, 0.12, 0.2, 0.04, 0.1)
# (temperature, top_k, top_p, min_p) of the frequency test: each filter alone, then together
SETTINGS = (
    (1.0, 0, 1.0, 0.0),
    (0.6, 0, 1.0, 0.0),
    (1.7, 0, 1.0, 0.0),
    (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.3),
    (0.8, 5, 0.75, 0.1),
)
LARGE_VOCAB = 151936  # Qwen3's: a vocabulary as large as models have, where float32 sums drift
Z_ONE_IN_A_MILLION = 4.753  # the standard normal's upper 1e-6 quantile


def sampling_tensors(
    vocab_size: int,
    temperature: float | Sequence[float],
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    min_p: float | Sequence[float] = 0.0,
    seeds: int | Sequence[int] = 0,
    steps: int | Sequence[int] = 0,
    device: torch.device | str = "cpu",
) -> SamplingTensors:
    """SamplingTensors for rows with these settings, as the runner builds them
    (ModelRunner.sampling_tensors): each a value for every row or a list of one per row; top_k 0
    means no limit (sent as the vocabulary size); seeds are 32-bit."""
    settings = [temperature, top_k, top_p, min_p, seeds, steps]
    num_rows = max((len(s) for s in settings if not isinstance(s, (int, float))), default=1)
    temperature, top_k, top_p, min_p, seeds, steps = (
        list(s) if not isinstance(s, (int, float)) else [s] * num_rows for s in settings
    )
    top_k = [k if k > 0 else vocab_size for k in top_k]
    return SamplingTensors(
        temperatures=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
        seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
        steps=torch.tensor(steps, dtype=torch.int64, device=device),
        all_greedy=not any(temperature),
        any_top_k=any(k < vocab_size for k in top_k),
        any_top_p=any(p < 1 for p in top_p),
        any_min_p=any(m > 0 for m in min_p),
    )


def support(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, slack: float = 0.0):
    """The tokens of each row of logits [N, V] that top_k, then top_p (over the top_k tokens'
    renormalized softmax(logits / T)), then min_p (probability at least min_p times the top
    one's) leave, as a bool mask. slack widens the top_p and min_p thresholds (relatively), for
    tokens so near one that float32 arithmetic may fall either side; tokens tied at a threshold
    are all kept."""
    logits = logits.double() / (temperature if temperature > 0 else 1.0)
    keep = torch.isfinite(logits)
    if 0 < top_k < logits.shape[-1]:
        keep &= logits >= logits.topk(top_k).values[:, -1:]
    if top_p < 1:
        probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
        ordered = probs.sort(descending=True).values
        # the mass of the tokens more probable than each: tokens tied with it may go either side
        first_tied = torch.searchsorted(-ordered, -probs)
        mass_before = (ordered.cumsum(-1) - ordered).gather(-1, first_tied)
        keep &= mass_before < top_p * (1 + slack) + slack
    if min_p > 0:
        probs = logits.softmax(-1)
        keep &= probs >= min_p * (1 - slack) * probs.max(-1, keepdim=True).values
    return keep


def target_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """softmax(logits / T) of each row of logits [N, V] over its support, renormalized, in float64."""
    scaled = logits.double() / temperature
    return scaled.masked_fill(~support(logits, temperature, top_k, top_p, min_p), float("-inf")).softmax(-1)


def chi_square_limit(degrees_of_freedom: int) -> float:
    """The chi-square statistic a correct sampler exceeds with probability about one in a million
    (Wilson and Hilferty's approximation)."""
    d = degrees_of_freedom
    return d * (1 - 2 / (9 * d) + Z_ONE_IN_A_MILLION * math.sqrt(2 / (9 * d))) ** 3


class SamplerSuite:
    """Subclass with `sampler` (a registered name) and optionally `sampler_options`, `device` and
    `dtypes`; pytest collects the subclass's tests, each once per dtype."""

    sampler: str = "default"
    sampler_options: dict = {}
    device: str = "cpu"
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    draws_per_setting = 4000  # of the frequency test, in calls of draws_per_call rows
    draws_per_call = 500

    def expected_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [N, V] the sampler draws from, before temperature and filters: the model's,
        unless the sampler reshapes them on purpose (a sampler that bans tokens sets theirs to
        -inf, for instance)."""
        return logits

    def pytest_generate_tests(self, metafunc):
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.dtypes, ids=[str(d).removeprefix("torch.") for d in self.dtypes])

    # -- helpers --------------------------------------------------------------------------------

    def make_sampler(self):
        config = EngineConfig(device=self.device)
        return get_registry().create("sampler", self.sampler, config, options=self.sampler_options)

    def sample(self, sampler, logits: torch.Tensor, **settings) -> torch.Tensor:
        """The sampler's tokens for logits and these settings (see sampling_tensors), on the CPU,
        after checking what the Protocol promises of them."""
        params = sampling_tensors(logits.shape[1], device=logits.device, **settings)
        with torch.inference_mode():  # as the runner calls it
            tokens = sampler(logits, params)
        num_rows = logits.shape[0]
        assert isinstance(tokens, torch.Tensor) and tuple(tokens.shape) == (num_rows,), (
            f"the sampler must return a tensor of {num_rows} token ids, got {getattr(tokens, 'shape', tokens)!r}"
        )
        assert tokens.dtype == torch.int64 and tokens.device == logits.device, (
            f"the sampler must return int64 ids on the logits' device {logits.device}, got {tokens.dtype} on {tokens.device}"
        )
        tokens = tokens.cpu()
        assert ((tokens >= 0) & (tokens < logits.shape[1])).all(), f"token ids outside the vocabulary: {tokens}"
        return tokens

    def random_logits(self, num_rows: int, vocab_size: int, dtype: torch.dtype, seed: int = 0, scale: float = 2.0):
        """Random logits in dtype on the device, each row's top expected logit alone at the top."""
        logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale
        top = self.expected_logits(logits).argmax(-1)
        logits[torch.arange(num_rows), top] += 1.0  # no tie at the top, even after rounding to bf16
        return logits.to(dtype).to(self.device)

    def designed_logits(self, dtype: torch.dtype) -> torch.Tensor:
        """One row of PROBS's log-probabilities, shifted (softmax ignores a shift)."""
        return (torch.tensor(PROBS).log() + 1.3).to(dtype)[None, :].to(self.device)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self.expected_logits(logits.cpu().float()).argmax(-1)

    # -- tests ----------------------------------------------------------------------------------

    def test_returns_one_token_id_a_row(self, dtype):
        sampler = self.make_sampler()
        for num_rows, vocab_size in ((1, 8), (7, 50), (3, LARGE_VOCAB)):
            logits = self.random_logits(num_rows, vocab_size, dtype)
            self.sample(sampler, logits, temperature=[0.0] + [1.0] * (num_rows - 1), top_k=[0] + [5] * (num_rows - 1))
            self.sample(sampler, logits, temperature=0.0)

    def test_greedy_rows_take_the_argmax(self, dtype):
        """Temperature 0 is greedy whatever the row's filters, the other rows and the step."""
        sampler = self.make_sampler()
        logits = self.random_logits(64, 1000, dtype, seed=1)
        expected = self.argmax(logits)
        greedy = torch.arange(64) % 2 == 0
        for step in range(3):
            got = self.sample(sampler, logits, temperature=0.0, seeds=list(range(64)), steps=step)
            assert torch.equal(got, expected), "an all-greedy batch must take each row's argmax"
            got = self.sample(
                sampler,
                logits,
                temperature=[0.0 if g else 1.0 for g in greedy.tolist()],
                top_k=[(i % 3) * 7 for i in range(64)],  # 0 (none), 7 or 14
                top_p=[1.0, 0.9, 0.5, 1.0][step % 4],
                min_p=[0.0, 0.05][step % 2],
                seeds=list(range(64)),
                steps=step,
            )
            assert torch.equal(got[greedy], expected[greedy]), "greedy rows beside sampled ones must take the argmax"

    def test_top_k_1_takes_the_argmax(self, dtype):
        sampler = self.make_sampler()
        logits = self.random_logits(32, 1000, dtype, seed=2)
        expected = self.argmax(logits)
        for temperature in (0.3, 1.0, 5.0):
            got = self.sample(sampler, logits, temperature=temperature, top_k=1, seeds=list(range(32)), steps=3)
            assert torch.equal(got, expected), f"top_k=1 must take the argmax (temperature {temperature})"
        got = self.sample(sampler, logits, temperature=1.0, top_k=[1, 0] * 16, seeds=list(range(32)))
        assert torch.equal(got[::2], expected[::2]), "top_k=1 rows beside unfiltered ones must take the argmax"

    def test_draws_stay_in_the_filters_support(self, dtype):
        """Thousands of draws never leave what top_k, top_p and min_p keep (tokens within float32
        rounding of a threshold may fall either side)."""
        sampler = self.make_sampler()
        num_rows = 128
        logits = self.random_logits(num_rows, 5000, dtype, seed=3)
        expected = self.expected_logits(logits.cpu().float())
        for temperature, top_k, top_p, min_p in (
            (1.0, 20, 1.0, 0.0),
            (0.7, 0, 0.3, 0.0),
            (1.3, 0, 1.0, 0.05),
            (1.0, 100, 0.8, 0.01),
        ):
            allowed = support(expected, temperature, top_k, top_p, min_p, slack=1e-3)
            for step in range(4):
                got = self.sample(
                    sampler,
                    logits,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    min_p=min_p,
                    seeds=list(range(num_rows)),
                    steps=step,
                )
                outside = ~allowed[torch.arange(num_rows), got]
                assert not outside.any(), (
                    f"temperature {temperature}, top_k {top_k}, top_p {top_p}, min_p {min_p}: rows "
                    f"{outside.nonzero().flatten().tolist()[:8]} drew tokens their filters exclude"
                )

    def test_draws_follow_the_distribution(self, dtype):
        """Over draws_per_setting draws (rows of many seeds, over several steps), each token's
        count matches softmax(logits / T) over the filters' support (chi-square, failing a correct
        sampler about once in a million), and no token outside it is drawn. Every fourth row is
        greedy, and must take the argmax."""
        sampler = self.make_sampler()
        row = self.designed_logits(dtype)
        expected_row = self.expected_logits(row.cpu().float())[0]
        rows = self.draws_per_call
        greedy = torch.arange(rows) % 4 == 0
        for temperature, top_k, top_p, min_p in SETTINGS:
            target = target_distribution(expected_row[None], temperature, top_k, top_p, min_p)[0]
            counts = torch.zeros_like(target)
            for step in range(self.draws_per_setting // int((~greedy).sum())):
                got = self.sample(
                    sampler,
                    row.expand(rows, -1).contiguous(),
                    temperature=[0.0 if g else temperature for g in greedy.tolist()],
                    top_k=top_k,
                    top_p=top_p,
                    min_p=min_p,
                    seeds=[1000 * step + i for i in range(rows)],
                    steps=[step * 7 + i % 5 for i in range(rows)],
                )
                assert (got[greedy] == expected_row.argmax()).all(), "greedy rows must take the argmax"
                counts += torch.bincount(got[~greedy], minlength=len(target)).double()
            what = f"temperature {temperature}, top_k {top_k}, top_p {top_p}, min_p {min_p}"
            impossible = target == 0
            assert counts[impossible].sum() == 0, (
                f"{what}: drew tokens {impossible.nonzero().flatten().tolist()} that have no probability"
            )
            expected_counts = target[~impossible] * counts.sum()
            statistic = ((counts[~impossible] - expected_counts) ** 2 / expected_counts).sum().item()
            degrees = int((~impossible).sum()) - 1
            if degrees > 0:
                assert statistic < chi_square_limit(degrees), (
                    f"{what}: drew {counts.tolist()}, expected {expected_counts.round().tolist()} over the support "
                    f"(chi-square {statistic:.1f} with {degrees} degrees of freedom)"
                )

    def test_a_seeded_row_draws_the_same_whatever_shares_its_batch(self, dtype):
        """A row's token is a function of its logits, settings, seed and step only: an unfiltered
        row draws the same among unfiltered rows, among filtered ones, among filtered and greedy
        rows of other settings, and alone; a filtered row the same in any of those batches; the
        same (seed, step) the same token again. Over a vocabulary as large as models have, where
        the least difference in arithmetic moves draws."""
        sampler = self.make_sampler()
        num_plain, num_filtered, num_others = 36, 6, 12
        num_probes = num_plain + num_filtered
        probes = self.random_logits(num_probes, LARGE_VOCAB, dtype, seed=4)
        others = self.random_logits(num_others, LARGE_VOCAB, dtype, seed=5)
        plain = dict(
            temperature=[0.5 + (i % 7) * 0.2 for i in range(num_plain)], seeds=[7919 * i for i in range(num_plain)]
        )
        filtered = dict(
            temperature=[0.6 + (i % 5) * 0.2 for i in range(num_filtered)],
            top_k=[40, 0, 0, 40, 0, 0][:num_filtered],
            top_p=[1.0, 0.9, 1.0, 0.95, 0.9, 1.0][:num_filtered],
            min_p=[0.0, 0.0, 0.02, 0.0, 0.01, 0.05][:num_filtered],
            seeds=[31 + i for i in range(num_filtered)],
        )
        other = dict(
            temperature=[[0.0, 1.0, 0.8][i % 3] for i in range(num_others)],
            top_k=[[5, 0, 50][i % 3] for i in range(num_others)],
            top_p=[[0.5, 0.95][i % 2] for i in range(num_others)],
            min_p=[[0.1, 0.0, 0.0, 0.3][i % 4] for i in range(num_others)],
            seeds=list(range(num_others)),
        )
        names = ("temperature", "top_k", "top_p", "min_p", "seeds")
        defaults = dict(top_k=0, top_p=1.0, min_p=0.0)

        def settings(*groups):
            return {name: [v for g, n in groups for v in g.get(name, [defaults.get(name)] * n)] for name in names}

        probe_settings = settings((plain, num_plain), (filtered, num_filtered))
        crowd_settings = settings((plain, num_plain), (filtered, num_filtered), (other, num_others))
        # the crowd in a shuffled order: position[i] is where row i of (probes, others) sits
        position = torch.randperm(num_probes + num_others, generator=torch.Generator().manual_seed(6))
        crowd = torch.empty(num_probes + num_others, LARGE_VOCAB, dtype=dtype, device=self.device)
        crowd[position.to(self.device)] = torch.cat([probes, others])
        shuffled = {name: [None] * len(position) for name in names}
        for name in names:
            for i, p in enumerate(position.tolist()):
                shuffled[name][p] = crowd_settings[name][i]
        for step in range(2):
            among_plain = self.sample(sampler, probes[:num_plain], **settings((plain, num_plain)), steps=step)
            again = self.sample(sampler, probes[:num_plain], **settings((plain, num_plain)), steps=step)
            assert torch.equal(among_plain, again), f"step {step}: the same seed and step gave another token"
            among_probes = self.sample(sampler, probes, **probe_settings, steps=step)
            in_crowd = self.sample(sampler, crowd, **shuffled, steps=step)[position[:num_probes]]
            for what, got, expected in (
                (
                    "unfiltered rows among unfiltered ones and among filtered ones",
                    among_probes[:num_plain],
                    among_plain,
                ),
                ("rows among their peers and among rows of other settings", in_crowd, among_probes),
            ):
                changed = (got != expected).nonzero().flatten().tolist()
                assert not changed, f"step {step}: {what} drew other tokens (rows {changed[:8]}, {len(changed)} in all)"
            for i in range(0, num_probes, 6):
                alone = self.sample(
                    sampler, probes[i : i + 1], **{k: v[i] for k, v in probe_settings.items()}, steps=step
                )
                assert alone.item() == among_probes[i].item(), f"step {step}: probe row {i} drew another token alone"

    def test_steps_and_seeds_give_other_draws(self, dtype):
        """Over a flat distribution, one seed's draws at 64 steps, and 64 seeds' draws at one step,
        are not the same token again and again."""
        sampler = self.make_sampler()
        flat = torch.zeros(64, 1000, dtype=dtype, device=self.device)
        by_step = self.sample(sampler, flat, temperature=1.0, seeds=12345, steps=list(range(64)))
        by_seed = self.sample(sampler, flat, temperature=1.0, seeds=list(range(64)), steps=9)
        for what, tokens in (("steps", by_step), ("seeds", by_seed)):
            assert len(set(tokens.tolist())) > 32, f"64 {what} over 1000 equally likely tokens drew {tokens.tolist()}"

    def test_a_graph_capturable_sampler_ignores_padding_rows_and_replays(self, dtype):
        """For a sampler that declares supports_cuda_graphs: the runner replays it over a decode
        batch padded to its graph's size, the padding rows holding other logits and stale settings
        under the flags of the real rows. The real rows draw what they draw alone, greedy and
        sampled; on CUDA, also when the call is captured in a CUDA graph and replayed with new
        seeds and steps written into its inputs."""
        sampler = self.make_sampler()
        if not (isinstance(sampler, GraphCapturableSampler) and sampler.supports_cuda_graphs):
            pytest.skip(f"sampler {self.sampler!r} does not declare supports_cuda_graphs")
        real, padded = 5, 8
        logits = self.random_logits(padded, LARGE_VOCAB, dtype, seed=8)
        stale = dict(temperature=[0.9, 0.0, 1.4], seeds=[1, 2, 3], steps=[4, 5, 6])
        for temperature in ([0.0] * real, [0.7, 0.0, 1.2, 0.9, 0.5]):
            mine = dict(temperature=temperature, seeds=[11, 12, 13, 14, 15], steps=[40, 41, 42, 43, 44])
            alone = self.sample(sampler, logits[:real], **mine)
            params = sampling_tensors(LARGE_VOCAB, device=self.device, **{k: v + stale[k] for k, v in mine.items()})
            params.all_greedy = not any(temperature)  # the graph is the real rows' kind
            with torch.inference_mode():
                beside = sampler(logits, params)[:real].cpu()
            assert torch.equal(beside, alone), f"temperatures {temperature}: padding rows changed the real rows' draws"
            if torch.device(self.device).type != "cuda":
                continue
            with torch.inference_mode():
                sampler(logits, params)  # loads its kernels before the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    tokens = sampler(logits, params)
                params.seeds[:real] = torch.tensor([21, 22, 23, 24, 25])
                params.steps[:real] += 7
                graph.replay()
                torch.cuda.synchronize()
            moved = dict(mine, seeds=[21, 22, 23, 24, 25], steps=[47, 48, 49, 50, 51])
            expected = self.sample(sampler, logits[:real], **moved)
            assert torch.equal(tokens[:real].cpu(), expected), (
                f"temperatures {temperature}: the replay drew other tokens"
            )

    def test_sample_with_logits_returns_the_distribution_drawn_from(self, dtype):
        """For a LogprobsSampler: the tokens __call__ draws, and float32 logits whose softmax is
        softmax(logits / T) over the filters' support (T taken as 1 on greedy rows)."""
        sampler = self.make_sampler()
        if not isinstance(sampler, LogprobsSampler):
            pytest.skip(f"sampler {self.sampler!r} does not implement LogprobsSampler")
        logits = self.random_logits(6, 300, dtype, seed=9)
        settings = dict(
            temperature=[0.0, 0.7, 1.0, 1.3, 0.0, 0.9],
            top_k=[0, 5, 0, 0, 3, 0],
            top_p=[1.0, 1.0, 0.8, 1.0, 1.0, 1.0],
            min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0],
            seeds=list(range(6)),
            steps=3,
        )
        params = sampling_tensors(300, device=logits.device, **settings)
        with torch.inference_mode():
            tokens, drawn_from = sampler.sample_with_logits(logits, params)
        assert torch.equal(tokens.cpu(), self.sample(sampler, logits, **settings)), "the tokens __call__ draws"
        assert drawn_from.dtype == torch.float32 and tuple(drawn_from.shape) == tuple(logits.shape)
        expected_logits = self.expected_logits(logits.cpu().float())
        for row in range(6):
            temperature = settings["temperature"][row] or 1.0
            filters = (settings["top_k"][row], settings["top_p"][row], settings["min_p"][row])
            target = target_distribution(expected_logits[row : row + 1], temperature, *filters)[0]
            got = drawn_from[row].cpu().double().softmax(-1)
            assert torch.allclose(got, target, atol=1e-5), f"row {row}: softmax of the returned logits"

    def test_adjustments_change_the_rows_they_name_only(self, dtype):
        """For a LogitsProcessingSampler: a +100 logit_bias makes a greedy row take its token, a
        ban keeps a row from its argmax, and the other rows draw what they draw without them."""
        sampler = self.make_sampler()
        if not isinstance(sampler, LogitsProcessingSampler):
            pytest.skip(f"sampler {self.sampler!r} does not implement LogitsProcessingSampler")
        vocab = 200
        logits = self.random_logits(4, vocab, dtype, seed=10)
        plain = self.sample(sampler, logits, temperature=0.0)
        params = sampling_tensors(vocab, 0.0, device=logits.device)
        device = logits.device
        params.adjustments = LogitsAdjustments(
            rows=torch.tensor([1, 3], device=device),
            presence=torch.zeros(2, device=device),
            frequency=torch.zeros(2, device=device),
            repetition=torch.ones(2, device=device),
            output_tokens=torch.zeros(0, dtype=torch.int64, device=device),
            prompt_tokens=torch.zeros(0, dtype=torch.int64, device=device),
            bias_index=torch.tensor([0 * vocab + 17], device=device),
            bias=torch.tensor([100.0], device=device),
            banned=torch.tensor([1 * vocab + int(plain[3])], device=device),
            any_penalty=False,
        )
        with torch.inference_mode():
            got = sampler(logits, params).cpu()
        assert got[1] == 17, "logit_bias +100 on row 1's token 17"
        assert got[3] != plain[3], "row 3's argmax is banned"
        assert got[0] == plain[0] and got[2] == plain[2], "rows without adjustments are unchanged"
