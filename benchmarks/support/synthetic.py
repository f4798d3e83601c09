"""Synthetic learner batches and random-weight models, so that the learner's step can be timed
where no vLLM runs (a GPU machine lent for minutes): `make bench-train-step ARGS=--synthetic`.

Two batch shapes, as issue 48 measured them: the arithmetic example's (2 groups of 8, 136-token
prompts, one short answer each) and an agent's (4 groups of 8, a 4,000-token prompt shared by the
group, 5 calls an episode with tool output between them, about 175k tokens). Token ids are
random below the tokenizer's vocabulary; an episode's advantage is +1 or -1.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from recorder.trajectories import NEUTRAL_LOGPROB, Span, TrainingSequence
from trainer.sample import Sample


@dataclass(frozen=True)
class Shape:
    groups: int
    episodes: int  # per group
    prompt: int  # tokens the group's episodes share
    calls: int  # an episode's, each a sampled completion; tool output between two
    completion: tuple[int, int]  # tokens of one, low and high
    tool: tuple[int, int]


SHAPES = {
    "arithmetic": Shape(2, 8, 136, 1, (40, 80), (0, 0)),
    "agent": Shape(4, 8, 4000, 5, (100, 200), (100, 240)),
}
# Model shapes (random weights from the config): the default model's own, and Qwen2.5-1.5B's.
MODELS = ("smollm2-135m", "qwen2.5-1.5b")


def synthetic_batch(shape: Shape, vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for g in range(shape.groups):
        prompt = [rng.randrange(3, vocab) for _ in range(shape.prompt)]
        for e in range(shape.episodes):
            ids, mask, logprobs, spans = list(prompt), [0] * len(prompt), [NEUTRAL_LOGPROB] * len(prompt), []
            for c in range(shape.calls):
                between = rng.randint(*shape.tool) if c else 0
                ids += [rng.randrange(3, vocab) for _ in range(between)]
                mask += [0] * between
                logprobs += [NEUTRAL_LOGPROB] * between
                start, n = len(ids), rng.randint(*shape.completion)
                ids += [rng.randrange(3, vocab) for _ in range(n)]
                mask += [1] * n
                logprobs += [rng.uniform(-4.0, -0.01) for _ in range(n)]
                spans.append(Span(start, len(ids), c + 1, "0", "0"))
            sequence = TrainingSequence(f"g{g}-e{e}", 0, ids, mask, logprobs, spans, False, group_id=f"g{g}")
            samples.append(Sample(sequence, rng.choice((-1.0, 1.0))))
    return samples


def random_model(name: str, tokenizer_dir: str, out: Path) -> str:
    """A model directory of `name`'s shape with random weights (seed 0) and the default model's
    tokenizer: what the learner loads."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    if name == "smollm2-135m":
        config = AutoConfig.from_pretrained(tokenizer_dir)
    elif name == "qwen2.5-1.5b":
        config = Qwen2Config(
            hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
            tie_word_embeddings=True,
        )  # fmt: skip
    else:
        raise ValueError(f"no model shape {name!r}: one of {', '.join(MODELS)}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return str(out)
