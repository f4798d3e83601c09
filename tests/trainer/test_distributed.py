"""The learner on two processes (torchrun, gloo on CPU) against one: the same batch, the same
step. SGD without clipping, so that the weights after the step are the gradient itself (Adam's
first step and a clipped norm would hide a gradient off by a factor)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from benchmarks.support.stack import Upstream

torch = pytest.importorskip("torch")

from tests.support.sequences import LORA, groups  # noqa: E402
from trainer.grpo import Learner  # noqa: E402
from trainer.run import torchrun_command  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SGD = {
    "optim": "sgd",
    "learning_rate": 1.0,
    "max_grad_norm": 1.0e9,
    "weight_decay": 0.0,
    "lr_scheduler_type": "constant",
}


def _two_processes(
    model: Path, cases: list[dict[str, Any]], crash: str = "", launcher: str = "torchrun"
) -> subprocess.CompletedProcess[str]:
    """One launch of two processes that runs `cases` one after another (tests/support/distributed_step.py)."""
    listed = Path(cases[0]["out"]) / "cases.json"
    listed.parent.mkdir(parents=True, exist_ok=True)
    listed.write_text(json.dumps(cases))
    command = torchrun_command(2, "tests.support.distributed_step", str(model), str(listed))
    if launcher == "accelerate":  # --multi_gpu without --cpu: torchrun underneath, gloo on CPU
        command = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "-m",
            "tests.support.distributed_step",
            str(model),
            str(listed),
        ]
    done = subprocess.run(
        command,
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "RLP_TEST_CRASH_RANK": crash},
    )
    assert done.returncode == 0 or crash, done.stderr[-3000:]
    return done


def _case(
    out: Path,
    grpo: dict[str, Any],
    micro_batch: int = 3,
    lora: Any = None,
    rows: int = 8,
    sharding: str = "replicate",
    resume: bool = False,
) -> dict[str, Any]:
    """One case of a launch (tests/support/distributed_step.py)."""
    return {"out": str(out), "grpo": grpo, "micro_batch": micro_batch, "lora": lora, "rows": rows,
            "sharding": sharding, "resume": resume}  # fmt: skip


CASES = {  # (grpo, micro_batch, lora, rows, sharding)
    "grpo-kl": ({"loss_type": "grpo", "beta": 0.1}, 8, None, 8, "replicate"),  # one pass of 4 rows per rank
    "bnpo-lora": ({"loss_type": "bnpo", "vllm_importance_sampling_mode": "token_mask"}, 3, LORA, 8, "replicate"),
    "dr_grpo-7": ({"loss_type": "dr_grpo"}, 3, None, 7, "replicate"),  # 1, 2, 2, 2 rows: rank 0's 1 gets a filler
    "dapo-1": ({"loss_type": "dapo"}, 8, None, 1, "replicate"),  # one row, two ranks: a pass of fillers
    "dapo-4-passes": ({"loss_type": "dapo"}, 3, None, 8, "replicate"),  # 8 rows in 4 passes, 2 per rank
    "fsdp2-kl": ({"loss_type": "grpo", "beta": 0.1}, 8, None, 7, "fsdp2"),  # with a sharded reference model
    # sharded, the shared-prompt path through it, with checkpointed layers
    "fsdp2-checkpointed": ({"loss_type": "dapo", "gradient_checkpointing": True}, 3, None, 8, "fsdp2"),
}
RESUMED = {"loss_type": "dapo", "temperature": 0.9}  # Adam: its state is what a resume must shard again


@pytest.fixture(scope="module")
def launched(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case above, and the FSDP2 run the resume test resumes, in one launch of two
    processes: by `accelerate launch`, as docs/deploying.md says (torchrun itself runs below:
    `rl-proxy train --processes 2` and the tests of a dying rank and of the resume)."""
    out = tmp_path_factory.mktemp("two-processes")
    cases = [
        _case(out / name, {**grpo, **SGD, "temperature": 0.9}, micro_batch, lora, rows, sharding)
        for name, (grpo, micro_batch, lora, rows, sharding) in CASES.items()
    ]
    _two_processes(tiny_model, [*cases, _case(out / "resumed", RESUMED, sharding="fsdp2")], launcher="accelerate")
    return out


@pytest.mark.parametrize("name", CASES)
def test_one_step_on_two_processes_equals_one_process(
    tiny_model: Path, launched: Path, tmp_path: Path, name: str
) -> None:
    grpo, micro_batch, lora, rows, sharding = CASES[name]
    grpo = {**grpo, **SGD, "temperature": 0.9}
    two_out = launched / name
    learner = Learner(str(tiny_model), tmp_path / "one", grpo, total_steps=1, micro_batch=micro_batch, lora=lora)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}
    one = learner.step(groups()[:rows])
    alone = {n: p.detach() for n, p in learner.model.named_parameters() if p.requires_grad}
    shared = torch.load(two_out / "trained-2.pt")
    assert shared.keys() == alone.keys()
    moved = 0
    for name_, weights in alone.items():
        torch.testing.assert_close(shared[name_] - before[name_], weights - before[name_], rtol=1e-4, atol=1e-6)
        moved += int(not torch.equal(weights, before[name_]))
    assert moved >= len(alone) // 2  # the step changed the weights (LoRA: B, not A, whose gradient is 0 at B = 0)
    two = json.loads((two_out / "metrics-2.json").read_text())
    whole = sum(p.numel() for p in learner.model.parameters())
    if sharding == "fsdp2":  # each rank holds about half the parameters
        assert abs(two["parameters_on_rank"] - whole / 2) < 0.01 * whole, (two["parameters_on_rank"], whole)
        # The shared-prompt path ran sharded: the same passes on both ranks, topped up where one
        # rank had fewer prompts in a micro-batch than the other (here in every case).
        plans = [json.loads((two_out / f"plans-{rank}.json").read_text()) for rank in (0, 1)]
        assert plans[0] and [p["run"] for p in plans[0]] == [p["run"] for p in plans[1]], plans
        assert any(p["own"] != p["run"] for rank in plans for p in rank), plans
    else:
        assert two["parameters_on_rank"] == whole
    for key in ("loss", "grad_norm", "logprob_gap"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key


def test_fsdp2_resumes_each_rank_from_its_own_shards(tiny_model: Path, launched: Path) -> None:
    """A checkpoint of an FSDP2 run (torch's distributed checkpoint, each rank writing its own
    shards; the launch above) resumed on two processes by torchrun: each rank reads back exactly
    the parameter and Adam state shards it had, and holds half of the optimizer state, never the
    whole. Each rank's peak memory while it resumed is measured (VmHWM) and printed; on the tiny
    model here it is noise, benchmarks/bench_scale.py has it for SmolLM2-135M."""
    out = launched / "resumed"
    _two_processes(tiny_model, [_case(out, RESUMED, sharding="fsdp2", resume=True)])
    whole = 2 * sum(p.numel() for p in Learner(str(tiny_model), out / "one", RESUMED, 1).model.parameters())
    for rank in (0, 1):
        had, resumed = torch.load(out / f"shards-{rank}.pt"), torch.load(out / f"resumed-{rank}.pt")
        for a, b in zip(had["parameters"], resumed["parameters"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(had["optimizer"], resumed["optimizer"], strict=True):
            assert a.keys() == b.keys() == {"step", "exp_avg", "exp_avg_sq"}
            assert all(torch.equal(a[k], b[k]) for k in a)
        held = sum(s[k].numel() for s in resumed["optimizer"] for k in ("exp_avg", "exp_avg_sq"))
        assert abs(held - whole / 2) < 0.01 * whole, (held, whole)
        memory = json.loads((out / f"resume-{rank}.json").read_text())
        print(f"rank {rank}: {memory['above']} bytes above its RSS while it resumed")


def test_a_rank_that_dies_stops_the_run_with_its_error(tiny_model: Path, tmp_path: Path) -> None:
    """Rank 1 fails before the first step: rank 0 does not wait on it forever, the launch fails
    and says why."""
    done = _two_processes(tiny_model, [_case(tmp_path, {"loss_type": "dapo"}, micro_batch=4)], crash="1")
    assert done.returncode != 0
    assert "rank 1 crashes on purpose" in done.stderr
    assert not (tmp_path / "trained-2.pt").exists()


@pytest.mark.timeout(600)
def test_train_on_two_processes_swaps_into_vllm(vllm: Upstream, restore: str, tmp_path: Path) -> None:
    """`rl-proxy train --processes 2` sharded (FSDP2): rank 0 collects a group through the proxy
    and the shared vLLM, both ranks step, rank 0 swaps version 1 in and writes the run's files;
    the weights it swaps in and checkpoints are gathered from both ranks (a whole
    model.safetensors), the learner's state beside them. Data parallel (replicate) takes the same
    path but for the sharding, whose step the tests above check against one process. Resumed:
    an FSDP2 learner on two processes (test_fsdp2_resumes_each_rank_from_its_own_shards), the
    loop (tests/trainer/test_train_vllm.py), `--resume` handed to every rank (tests/test_cli.py)."""
    sharding = "fsdp2"
    example = ROOT / "harness_adapters" / "examples" / "arithmetic"
    config = yaml.safe_load((example / "train.yaml").read_text())
    config.update(tasks=str(example / "tasks.jsonl"), out=str(tmp_path / "run"), episodes_per_task=4, concurrency=8)
    config["harness"]["agent"] = str(example / "agent.py") + ":agent"
    config["rewards"][0]["function"] = str(example / "agent.py") + ":score"
    config["proxy"] = {"upstream": vllm.url}
    config["train"].update(steps=1, groups_per_step=1, micro_batch=2, sharding=sharding)
    del config["eval"]
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "train", str(path), "--processes", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("1 steps (sync), policy version 1") == 1  # rank 0 alone reports
    # A line a group; a group whose rewards are all equal trains nothing, and another is collected.
    groups = [line for line in done.stdout.splitlines() if line.startswith("step 1: group ")]
    assert groups and groups[-1].endswith("(1/1 for the step)"), groups
    assert all(line.endswith("nothing to train (0/1 for the step)") for line in groups[:-1]), groups
    assert httpx.get(f"{restore}/weight_info").json()["weight_version"] == "1"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["samples"] >= 4
    from safetensors.torch import load_file
    from transformers import AutoConfig

    saved = load_file(tmp_path / "run" / "versions" / "v1" / "model.safetensors")
    hidden = AutoConfig.from_pretrained(tmp_path / "run" / "versions" / "v1").hidden_size
    assert saved["model.norm.weight"].shape == (hidden,)  # whole, not a rank's shard
    assert "lm_head.weight" not in saved  # SmolLM2 ties it to the embeddings: saved once, and still tied
    assert (tmp_path / "run" / "versions" / "v1" / "learner" / "scheduler.pt").exists()


def test_the_shipped_multi_gpu_configs_load() -> None:
    """harness_adapters/examples/arithmetic/{train-8gpu,train-8gpu-fsdp2,accelerate-4gpu}.yaml (not run
    here: no GPU)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    from harness_adapters.config import load_config
    from trainer.config import TrainConfig

    example = ROOT / "harness_adapters" / "examples" / "arithmetic"
    cluster = load_config_from_file(str(example / "accelerate-4gpu.yaml"))
    assert (cluster.distributed_type, cluster.num_processes) == (DistributedType.MULTI_GPU, 4)
    assert cluster.gpu_ids == "4,5,6,7"
    config = load_config(example / "train-8gpu.yaml", TrainConfig)
    assert config.train.weight_sync == "nccl" and config.proxy.upstream and config.train.grpo["bf16"]
    assert config.train.groups_per_step * config.episodes_per_task >= 4 * config.train.micro_batch  # every rank busy
    sharded = load_config(example / "train-8gpu-fsdp2.yaml", TrainConfig)
    assert (sharded.train.sharding, sharded.train.weights_dtype, sharded.train.weight_sync) == (
        "fsdp2",
        "float32",
        "disk",
    )
    assert sharded.train.grpo["bf16"] and sharded.train.groups_per_step * sharded.episodes_per_task >= 32
