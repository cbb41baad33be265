"""The verifiable task: sort a list of digits, with a programmatic reward.

A prompt is ``BOS d_1 .. d_n SEP`` and the right completion is the digits sorted ascending followed
by ``EOS``. The list length ``n`` is drawn from a skewed distribution (many short lists, a few long
ones), so completions have varying lengths and a batch of generations drains unevenly: the
long-tail effect that piche2025pipelinerl's introduction describes for reasoning traces, in miniature.

Reward (a verifiable reward, as in the paper's reasoning tasks): 1.0 when the completion is exactly the sorted list
followed by EOS, else 0.0. Every prompt and every sampling draw is a pure function of
``(seed, index)``, so two runs that generate the same sample index see the same prompt and the same
random numbers, whatever the timing: this is what makes the lr = 0 comparison exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vocabulary: the ten digits, then the format tokens
SEP, BOS, EOS, PAD = 10, 11, 12, 13
VOCAB = 14


@dataclass(frozen=True)
class TaskConfig:
    """Lengths of the lists to sort.

    ``min_items..max_items`` is the range of ``n``. ``dist = "skew"`` (the default): ``skew >= 1``
    biases ``n`` towards short lists (``n = min + floor((max - min + 1) * U ** skew)``, U uniform).
    ``dist = "lognormal"``: ``n = clamp(round(median * exp(sigma * Z)), min, max)``, Z standard
    normal: a heavy tail, the longest list of a batch many times the typical one, as with
    reasoning traces (the regime where the simulator finds pipeline's largest gains).
    """

    min_items: int = 1
    max_items: int = 8
    skew: float = 2.0
    dist: str = "skew"
    median: float = 8.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_items <= self.max_items:
            raise ValueError(
                f"TaskConfig: need 1 <= min_items <= max_items, got min_items={self.min_items}, "
                f"max_items={self.max_items}"
            )
        if self.skew < 1:
            raise ValueError(f"TaskConfig.skew must be >= 1 (1 = uniform lengths), got {self.skew}")
        if self.dist not in ("skew", "lognormal"):
            raise ValueError(f"TaskConfig.dist must be 'skew' or 'lognormal', got '{self.dist}'")
        if not (self.median > 0 and self.sigma >= 0):
            raise ValueError(
                f"TaskConfig: need median > 0 and sigma >= 0, got median={self.median}, sigma={self.sigma}"
            )

    def draw_items(self, generator: torch.Generator, shape: tuple[int, ...] = ()) -> torch.Tensor:
        """List lengths ``n`` (long tensor of ``shape``) drawn from this task's distribution."""
        lo, hi = self.min_items, self.max_items
        if self.dist == "lognormal":
            z = torch.randn(shape, generator=generator, dtype=torch.float64)
            return torch.round(self.median * torch.exp(self.sigma * z)).long().clamp(lo, hi)
        u = torch.rand(shape, generator=generator)
        return lo + (((hi - lo + 1) * u**self.skew).long()).clamp(max=hi - lo)

    @property
    def max_prompt_len(self) -> int:
        return self.max_items + 2  # BOS, digits, SEP

    @property
    def max_new_tokens(self) -> int:
        return self.max_items + 1  # sorted digits, EOS

    @property
    def max_seq_len(self) -> int:
        return self.max_prompt_len + self.max_new_tokens


def _gen(seed: int, index: int, stream: int) -> torch.Generator:
    # one independent stream per (seed, index, purpose); a large odd multiplier keeps them apart
    return torch.Generator().manual_seed((seed * 1_000_003 + index) * 4 + stream)


def make_prompt(task: TaskConfig, seed: int, prompt_index: int) -> list[int]:
    """The prompt of one problem: ``[BOS, d_1, .., d_n, SEP]`` (a list of token ids)."""
    g = _gen(seed, prompt_index, 0)
    if task.dist == "skew":  # in Python floats, as before the lognormal option (same prompts)
        u = torch.rand((), generator=g).item()
        span = task.max_items - task.min_items + 1
        n = task.min_items + min(span - 1, int(span * u**task.skew))
    else:
        n = int(task.draw_items(g))
    digits = torch.randint(0, 10, (n,), generator=g).tolist()
    return [BOS, *digits, SEP]


def sampling_uniforms(task: TaskConfig, seed: int, sample_index: int) -> torch.Tensor:
    """``[max_new_tokens]`` uniforms in [0, 1) that decide sample ``sample_index``'s tokens."""
    return torch.rand(task.max_new_tokens, generator=_gen(seed, sample_index, 1), dtype=torch.float64)


def solution(prompt: list[int]) -> list[int]:
    """The right completion of a prompt: the digits sorted, then EOS."""
    if len(prompt) < 3 or prompt[0] != BOS or prompt[-1] != SEP:
        raise ValueError(f"solution: a prompt is [BOS, digits.., SEP], got {prompt}")
    return [*sorted(prompt[1:-1]), EOS]


def reward(prompt: list[int], completion: list[int]) -> float:
    """1.0 when ``completion`` (generated tokens, EOS included if produced) is exactly right."""
    return 1.0 if list(completion) == solution(prompt) else 0.0


#: The smallest task worth training on (lists of 1 to 4 digits, sequences of at most 11 tokens): the CPU
#: tests' and the lab's, whose policy (``model.TINY_MODEL``) pre-trains in seconds.
TINY_TASK = TaskConfig(min_items=1, max_items=4, skew=1.5)

# Presets for ``--task`` (train.py, bench.py): the benchmark's default task, and its heavy-tailed
# variant with long lists (sequences of 2n + 3 tokens, prompt fed token by token).
TASKS = {
    "sort": TaskConfig(min_items=1, max_items=16, skew=2.0),
    "sort-long": TaskConfig(min_items=1, max_items=96, dist="lognormal", median=16.0, sigma=1.0),
}


def sft_batch(
    task: TaskConfig, batch: int, generator: torch.Generator, noise: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A supervised batch for pre-training the policy on the task format.

    Returns ``tokens [batch, max_seq_len]`` (PAD after EOS) and ``loss_mask [batch, max_seq_len]``
    (True at the positions whose token is a completion token, to be predicted from the previous
    position). With ``noise > 0`` each completion digit is replaced by a random digit with that
    probability: the pre-trained policy then makes mistakes at about that rate, so RL starts from a
    non-zero but imperfect reward and has something to learn.
    """
    if not 0.0 <= noise < 1.0:
        raise ValueError(f"sft_batch: noise must be in [0, 1), got {noise}")
    n = task.draw_items(generator, (batch,))  # [batch], as make_prompt
    m = task.max_items
    col = torch.arange(m)[None, :]
    inside = col < n[:, None]  # [batch, m]
    digits = torch.randint(0, 10, (batch, m), generator=generator)
    answer = torch.sort(torch.where(inside, digits, 10), dim=1).values  # padding sorts last
    flip = (torch.rand(batch, m, generator=generator) < noise) & inside
    answer = torch.where(flip, torch.randint(0, 10, (batch, m), generator=generator), answer)
    L = task.max_seq_len
    tokens = torch.full((batch, L), PAD, dtype=torch.long)
    mask = torch.zeros((batch, L), dtype=torch.bool)
    rows = torch.arange(batch)
    tokens[:, 0] = BOS
    tokens[:, 1 : m + 1] = torch.where(inside, digits, PAD)
    tokens[rows, n + 1] = SEP
    col1 = torch.arange(m + 1)[None, :]
    pos = (n + 2)[:, None] + col1  # completion positions: n digits, then EOS
    keep = col1 <= n[:, None]
    ans = torch.cat([answer, torch.full((batch, 1), EOS)], 1)
    ans = torch.where(col1 < n[:, None], ans, EOS)
    rows2 = rows[:, None].expand(-1, m + 1)
    tokens[rows2[keep], pos[keep]] = ans[keep]
    mask[rows2[keep], pos[keep]] = True
    return tokens, mask
