"""Actors and trainers in their own processes (``launch.py``), on CPU processes with gloo: the GPU code in CI.

Every test starts a real ``torchrun`` job of three or four processes (the toy model, a few optimizer
steps per mode) under a timeout, so nothing here can hang:

* 1 trainer + 2 actors, the three modes in one job: each mode trains its steps; weights reach the
  actors mid-sequence in pipeline mode only (samples whose tokens carry two versions); the version
  bookkeeping holds on every trained sample; every sample index is accounted for exactly once
  (trained, dropped, queued, in flight at the stop, or granted but not started); every process
  reports its busy time.
* 2 data-parallel trainers + 1 actor: the same, and both trainers end with the same weights; in a
  separate check without processes, two trainers' steps on halves of a batch give the weights of one
  step on the whole batch.
* 1 trainer + 3 actors, conventional mode: every round reaches every actor (the grant rotation that
  left one of three actors idle on the H100s); beside it, without processes, the admission grants
  (``allocate_grants``) are whole groups, within the window, work-conserving and fair.
* Faults: an actor, or the lead trainer, killed with SIGKILL after a few steps ends the job with a
  non-zero status and a message naming the dead process, well before the job's own time limit.
* The plan's report turns a launch's results into a Report with the simulator's predictions beside
  them; the plan's sizes are valid launches; the GPU plan script parses.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

from paperclub.testing import sanitizing
from repro.pipelinerl.actor import Engine
from repro.pipelinerl.launch import TINY
from repro.pipelinerl.model import ModelConfig, Policy, flat_weights, load_flat_weights, pretrain
from repro.pipelinerl.pipeline import MODES, make_groups
from repro.pipelinerl.trainer import rl_step

ROOT = Path(__file__).resolve().parents[3]
SECTION = "Abstract (arXiv v1)"
TINY_MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_len=TINY.max_seq_len)
LAUNCH = ["--task", "tiny", "--d-model", "32", "--layers", "2", "--heads", "2", "--slots", "8",
          "--batch-size", "8", "--attempts", "2", "--max-lag", "8", "--lr", "1e-2"]  # fmt: skip
JOB_TIMEOUT_S = 150  # the whole torchrun job, start-up of three Python processes included


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory) -> Path:
    """The toy policy pre-trained a little, saved as ``plan.py pretrain`` saves it."""
    torch.manual_seed(0)
    model = Policy(TINY_MODEL)
    pretrain(model, TINY, steps=60, batch=32, lr=1e-2, noise=0.2, seed=0)
    path = tmp_path_factory.mktemp("launch") / "weights.pt"
    torch.save({"weights": flat_weights(model), "model": TINY_MODEL.__dict__, "task": "tiny"}, path)
    return path


def torchrun(nproc: int, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'site'}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--monitor-interval", "1", "-m", "repro.pipelinerl.launch", "--device", "cpu", *LAUNCH, *args]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def three_modes(weights_file, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("launch") / "launch-1+2.json"
    # max_lag 3 B: up to 32 samples in flight on 16 slots, so that swaps find sequences in progress
    proc, _ = torchrun(3, "--trainers", "1", "--modes", ",".join(MODES), "--steps", "20", "--max-lag", "24",
                       "--time-per-mode", "60", "--weights", str(weights_file), "--stall-s", "40", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.claim("pipelinerl/disjoint-devices", section=SECTION)
@pytest.mark.parametrize("mode", MODES)
def test_one_trainer_two_actors_in_their_own_processes(three_modes, mode):
    doc = three_modes
    assert (doc["trainers"], doc["actors"], doc["world"], doc["backend"]) == (1, 2, 3, "gloo")
    res = doc["modes"][mode]
    sm, acc = res["summary"], res["accounting"]
    assert sm["steps"] == 20 and sm["samples"] == 20 * 8
    assert res["version_check"] == "ok"
    assert acc["ok"], acc["problems"]
    assert acc["started"] == sum(acc[k] for k in ("trained", "dropped", "queued", "in_flight", "unstarted"))
    assert acc["trained"] == sm["samples"]
    # in-flight updates only in pipeline mode: weights changed under sequences in progress
    if mode == "pipeline":
        assert sm["mixed_version_samples"] > 0
    else:
        assert sm["mixed_version_samples"] == 0
    assert sm["lag_max"] <= doc["config"]["max_lag"]
    assert sorted(b["rank"] for b in res["busy"]) == [0, 1, 2]
    for b in res["busy"]:  # (which actor gets how much of the work depends on timing: only bounds here)
        assert 0.0 <= b["busy"] <= 1.0, b
    assert res["busy"][0]["busy"] > 0 and sum(b["busy"] for b in res["busy"][1:]) > 0
    assert abs(sum(res["lag_hist"].values()) - 1.0) < 1e-9
    # the actors' loop time outside engine steps, split; every SAMPLES message sent was received
    actors = [b for b in res["busy"] if b["role"] == "actor"]
    for b in actors:
        assert min(b["idle_s"], b["broadcast_s"], b["host_s"]) >= 0.0, b
        assert b["busy_s"] + b["idle_s"] + b["broadcast_s"] <= b["window_s"] + 1e-6, b
    assert res["busy"][0]["messages_received"] == sum(b["messages"] for b in actors) > 0
    assert res["busy"][0]["receiver_handling_s"] >= 0.0


@pytest.mark.claim("pipelinerl/disjoint-devices", section=SECTION)
def test_two_data_parallel_trainers_and_an_actor(weights_file, tmp_path):
    out = tmp_path / "launch-2+1.json"
    proc, _ = torchrun(3, "--trainers", "2", "--modes", "pipeline,conventional", "--steps", "8", "--time-per-mode",
                       "60", "--weights", str(weights_file), "--stall-s", "40", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    for mode in ("pipeline", "conventional"):
        res = doc["modes"][mode]
        assert res["summary"]["steps"] == 8 and res["accounting"]["ok"] and res["version_check"] == "ok"
        assert res["summary"]["replicas_equal"], "the two trainers' weights diverged"
        assert sorted((b["rank"], b["role"]) for b in res["busy"]) == [
            (0, "trainer"),
            (1, "trainer"),
            (2, "actor"),
        ]


@pytest.mark.claim("pipelinerl/disjoint-devices", section=SECTION)
def test_conventional_rounds_reach_every_actor(weights_file, tmp_path):
    """1 trainer + 3 actors (four processes), conventional mode: each round of ``G B`` samples is
    granted at once, when the lead publishes new weights, to three idle actors, and each gets a fair
    share. The sizes scale the 1+3 run on four H100s down by 8 (16 slots per actor, rounds of G B =
    3 x 8 = 24 samples, shares of 8 = half an actor's slots, as 64 of 128 there), where the rotation
    bug fixed in ``allocate_grants`` offered one actor nothing after the first round, every round
    (on the H100s: actor 1 idle for the whole mode). Eight rounds: with the bug that actor starts
    at most the first round's 16 samples; asserted: every actor starts at least half the mean.
    (Which actor gets most of the start-up round depends on who reports first; only the bound is
    timing-free.)"""
    out = tmp_path / "launch-1+3.json"
    proc, _ = torchrun(4, "--trainers", "1", "--modes", "conventional", "--slots", "16", "--batch-size", "8",
                       "--max-lag", "16", "--steps", "24", "--time-per-mode", "60", "--weights", str(weights_file),
                       "--stall-s", "40", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())["modes"]["conventional"]
    assert res["summary"]["steps"] == 24 and res["accounting"]["ok"], res["accounting"]
    started = [a["started"] for a in res["accounting"]["per_actor"]]
    assert len(started) == 3 and sum(started) >= 24 * 8, started
    assert min(started) >= 0.5 * sum(started) / 3, f"an actor was starved of work: started {started}"


@settings(max_examples=400, deadline=None)
@given(
    asks=hst.lists(hst.integers(-16, 200), min_size=1, max_size=5),
    room=hst.integers(0, 400),
    attempts=hst.sampled_from([1, 2, 8]),
    start=hst.integers(0, 4),
)
def test_grants_are_whole_groups_and_fair(asks, room, attempts, start):
    """``allocate_grants``: whole groups, never more than an actor asks or the window holds; no room
    left unused while an actor still asks for a whole group; and fair: every actor gets at least
    its fair share of the window, or all it asks, or what the shares of the actors before it in
    the order left (the share is rounded up to whole groups, so the window can run out early). The
    bug this guards against: an actor asking for a whole round got nothing while another got two
    shares."""
    from repro.pipelinerl.launch import allocate_grants

    start %= len(asks)
    grants, nxt = allocate_grants(asks, room, attempts, start)
    got = [0] * len(asks)
    for a, n in grants:
        assert n > 0 and n % attempts == 0
        got[a] += n
    want = [max(0, x) // attempts * attempts for x in asks]
    assert sum(got) <= max(room, 0)
    assert all(g <= w for g, w in zip(got, want, strict=True))
    left = max(room, 0) - sum(got)
    assert left < attempts or got == want, (got, want, left)
    if room > 0:
        share = -(-room // (len(asks) * attempts)) * attempts
        order = [(start + k) % len(asks) for k in range(len(asks))]
        for pos, a in enumerate(order):  # at its turn in the first pass at least room - pos shares are left
            rest = (room - pos * share) // attempts * attempts
            assert got[a] >= min(want[a], share, rest), (a, got, want, share)
    assert 0 <= nxt < len(asks)
    if grants:
        assert nxt == (grants[0][0] + 1) % len(asks)  # the next call starts one past the first served


def test_a_round_over_three_idle_actors():
    """The case of the H100 run: a conventional round (G B = 192, groups of 8) over three idle actors
    asking for 128 slots each goes out as 64 + 64 + 64, whichever actor the rotation starts at."""
    from repro.pipelinerl.launch import allocate_grants

    for start in range(3):
        grants, nxt = allocate_grants([128, 128, 128], 192, 8, start)
        assert sorted(grants) == [(0, 64), (1, 64), (2, 64)] and nxt == (start + 1) % 3
    # two actors (the 2+2 placement): 96 + 96, not 128 + 64
    assert sorted(allocate_grants([128, 128], 192, 8, 0)[0]) == [(0, 96), (1, 96)]


def test_data_parallel_step_equals_one_step_on_the_whole_batch(weights_file):
    """Two trainers (threads with gloo groups), each on half of the batch's groups, make the step one
    trainer makes on the whole batch: same loss, gradient and weights (fp32 sums in another order:
    1e-6 relative). The statistics are the whole batch's."""
    init = torch.load(weights_file, weights_only=False)["weights"]
    model = Policy(TINY_MODEL).eval()
    load_flat_weights(model, init)
    engine = Engine(model, TINY, 8, seed=5, attempts=2)
    batch: dict = {}
    nxt = 0
    while len(batch) < 8:
        k = min(len(engine.free), 8 - nxt)
        engine.add_many(list(range(nxt, nxt + k)))
        nxt += k
        for s in engine.step():
            batch[s.index] = s
    samples = [batch[i] for i in range(8)]

    def fresh() -> tuple[Policy, torch.optim.Optimizer]:
        m = Policy(TINY_MODEL)
        load_flat_weights(m, init)
        return m, torch.optim.Adam(m.parameters(), lr=1e-2)

    m1, o1 = fresh()
    whole = rl_step(m1, o1, samples, attempts=2, is_cap=1.2)
    pgs = make_groups(2)
    groups = [samples[i : i + 2] for i in range(0, 8, 2)]
    shares = [[s for g in groups[r::2] for s in g] for r in range(2)]
    models = [fresh() for _ in range(2)]
    stats: list = [None, None]

    def trainer(r: int) -> None:
        stats[r] = rl_step(*models[r], shares[r], attempts=2, is_cap=1.2, world_batch=8, group=pgs[r])

    threads = [threading.Thread(target=trainer, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    ref = flat_weights(m1)
    for m, _ in models:
        w = flat_weights(m)
        assert float((w - ref).norm() / ref.norm()) <= 1e-6
    assert torch.equal(flat_weights(models[0][0]), flat_weights(models[1][0]))  # replicas: bitwise
    for st in stats:
        assert st["reward"] == pytest.approx(whole["reward"], abs=1e-12)
        assert st["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
        assert st["ess"] == pytest.approx(whole["ess"], rel=1e-9)
        assert st["tokens"] == whole["tokens"]


@pytest.mark.claim("pipelinerl/disjoint-devices", section=SECTION)
@pytest.mark.parametrize(
    "fault, named",
    [("actor:1@3", "actor 1 (rank 2) died"), ("trainer@3", "trainer 0 (rank 0) died")],
    ids=["actor-dies", "trainer-dies"],
)
def test_a_dead_process_ends_the_run_with_its_name(weights_file, tmp_path, fault, named):
    """SIGKILL after step 3 of a run that would otherwise train for 600 s: the job ends on its own
    (within the test's timeout, a quarter of that), with a message naming the dead process, printed
    by the survivor that saw its connection close, and a record of it next to ``--out``. Had the
    survivors hung, the 40 s stall guard would have ended the job with another message."""
    out = tmp_path / "run.json"
    proc, _ = torchrun(3, "--trainers", "1", "--modes", "pipeline", "--time-per-mode", "600", "--fault", fault,
                       "--weights", str(weights_file), "--stall-s", "40", "--out", str(out))  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    assert named in text, text[-3000:]
    assert "no batch for" not in text, text[-3000:]
    records = [json.loads(p.read_text()) for p in tmp_path.glob("run.error-rank*.json")]
    assert any(named in r["error"] for r in records), records


def test_plan_report_from_a_launch(three_modes, tmp_path, capsys):
    """``plan.py report``: measured rows beside the simulator's predictions, busy, lag, curves; every
    plot names existing columns; the summary prints."""
    from repro.pipelinerl.plan import COLUMNS, print_summary, report_step

    d = tmp_path / "raw"
    d.mkdir()
    (d / "launch-1+2.json").write_text(json.dumps(three_modes))
    c = three_modes["config"]
    onegpu = {
        "runs": {m: {"summary": {**r["summary"]}, "steps": r["steps"], "busy": r["busy"][:2]}
                 for m, r in three_modes["modes"].items()},
        "time_model": {"step_s": 1e-3, "step_s_per_seq": 1e-5, "train_s": 5e-3, "broadcast_s": 1e-3, "swap_s": 1e-4},
        "lengths": [[3, 2, 5], [5, 4, 3]], "train_step_s": {"full": 5e-3, "half": 3e-3, "half_over_full": 0.6},
        "config": c,
    }  # fmt: skip
    (d / "onegpu.json").write_text(json.dumps(onegpu))
    (d / "fault-actor.json").write_text(json.dumps({"case": "actor", "rc": 1, "seconds": 5.0, "named": True,
                                                    "first_report": "actor 0 (rank 1) died", "ok": True}))  # fmt: skip
    path = report_step(d, tmp_path, "placements-test", sim_steps=20)
    doc = json.loads(path.read_text())
    kinds = {r["kind"] for r in doc["rows"]}
    assert {"run", "sim", "tput", "busy", "curve", "lag", "fault"} <= kinds
    runs = [r for r in doc["rows"] if r["kind"] == "run" and r["placement"] == "1+2"]
    assert {r["mode"] for r in runs} == set(MODES)
    for r in runs:
        assert r["pred_tokens_per_s"] > 0 and r["accounting"] == "ok" and r["check"] == "ok"
    assert [r for r in runs if r["mode"] == "conventional"][0]["vs_conv_tokens"] == pytest.approx(1.0)
    for p in doc["plots"]:
        for col in (p["x"], p["y"], p["series"], *(p["where"] or {}), *([p["facet"]] if p["facet"] else [])):
            assert col in COLUMNS
    assert doc["device_count"] == 3 and "pipeline / conventional" in doc["notes"]
    print_summary(doc["rows"])
    assert "1+2" in capsys.readouterr().out


def test_plan_report_tells_launches_of_one_placement_apart(three_modes, tmp_path):
    """The two-GPU plan's report: several launches of one placement (lr 0, two seeds) each with their
    own ratio, learning rate and seed, and their own series in the throughput plot."""
    from repro.pipelinerl.plan import report_step

    d = tmp_path / "raw"
    d.mkdir()
    for lr, seed in ((0.0, 0), (1e-2, 1)):
        doc = copy.deepcopy(three_modes)
        doc["placement"] = f"1+2 lr{lr:g}-seed{seed}"
        doc["config"] |= {"lr": lr, "seed": seed}
        (d / f"launch-1+2-lr{lr:g}-seed{seed}.json").write_text(json.dumps(doc))
    doc = json.loads(report_step(d, tmp_path, "placements-2gpu", sim_steps=20).read_text())
    assert doc["device_count"] == 3  # the launches' world
    labels = {r["label"] for r in doc["rows"] if r["kind"] == "tput"}
    assert len(labels) == 2 * 3 and "pipeline, 1+2 lr0-seed0" in labels
    assert "lr 0.0, seed 0): pipeline / conventional" in doc["notes"]
    assert "lr 0.01, seed 1): pipeline / conventional" in doc["notes"]


def test_plan_ingest_never_replaces_other_results(tmp_path):
    """``plan.py ingest`` unpacks only under repro/pipelinerl/results/ and refuses to replace an
    existing file with different contents unless told to (the 4-GPU results stay when a 2-GPU run
    comes in); a file already there with the same contents is fine."""
    import tarfile

    from repro.pipelinerl.plan import ingest

    src, root = tmp_path / "src", tmp_path / "repo"
    res = Path("repro/pipelinerl/results")
    (src / res / "raw-2gpu").mkdir(parents=True)
    (src / res / "x-results-2gpu.json").write_text('{"new": 1}')
    (src / res / "raw-2gpu" / "steps.tsv").write_text("step\n")
    (root / res).mkdir(parents=True)
    (root / res / "x-placements.json").write_text('{"four gpus": 1}')
    tgz = tmp_path / "a.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(src / res, arcname=str(res))  # as gpu_plan.sh packs it: no parent folders
    ingest(tgz, root)  # new files only: unpacked, the 4-GPU file untouched
    assert (root / res / "x-results-2gpu.json").read_text() == '{"new": 1}'
    assert (root / res / "x-placements.json").read_text() == '{"four gpus": 1}'
    ingest(tgz, root)  # again: the same contents, nothing to refuse
    (root / res / "x-results-2gpu.json").write_text('{"edited": 1}')
    with pytest.raises(SystemExit, match=r"refusing to replace existing results.*x-results-2gpu\.json"):
        ingest(tgz, root)
    assert (root / res / "x-results-2gpu.json").read_text() == '{"edited": 1}'
    ingest(tgz, root, overwrite=True)
    assert (root / res / "x-results-2gpu.json").read_text() == '{"new": 1}'
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(src / res, arcname="elsewhere/results")
    with pytest.raises(SystemExit, match=r"refusing elsewhere"):
        ingest(tgz, root)


def test_pretrain_stops_after_steps_on_the_full_schedule():
    """``stop_after`` ends pre-training after that many steps with the long schedule's learning
    rates (the two-GPU plan's start from the 4-GPU run's 201 steps); 0 steps is refused."""
    runs = []
    for steps, stop_after in ((40, 3), (3, None)):
        torch.manual_seed(0)
        model = Policy(TINY_MODEL)
        info = pretrain(model, TINY, steps=steps, batch=4, lr=1e-2, seed=0, stop_after=stop_after)
        runs.append((info["steps"], flat_weights(model)))
    assert runs[0][0] == runs[1][0] == 3
    # the same data, but the 40-step schedule is still warming up at step 3: other weights
    assert not torch.equal(runs[0][1], runs[1][1])
    with pytest.raises(ValueError, match=r"stop_after must be at least 1 step, got 0"):
        pretrain(Policy(TINY_MODEL), TINY, steps=10, stop_after=0)


def test_plan_sizes_are_valid_launches():
    """The GPU plan's sizes (full and smoke) make valid configurations for every mode, split into
    whole groups over two trainers, and the plan script parses."""
    from repro.pipelinerl.plan import SIZES, _config

    for kind, sizes in SIZES.items():
        for mode in MODES:
            _config(sizes, mode).validate()
        assert sizes["batch-size"] % (2 * sizes["attempts"]) == 0, kind
        assert sizes["slots"] >= sizes["attempts"], kind
    proc = subprocess.run(
        ["bash", "-n", str(ROOT / "repro/pipelinerl/gpu_plan.sh")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_launch_refuses_bad_arguments():
    from repro.pipelinerl.launch import parse_fault

    assert parse_fault("actor:1@5") == ("actor", 1, 5) and parse_fault("trainer@3") == ("trainer", 0, 3)
    for bad in ("actor:1", "trainer:1@2", "gpu@3", "actor:0@0"):
        with pytest.raises(SystemExit, match=r"--fault must be actor:K@S or trainer@S"):
            parse_fault(bad)


def test_channel_round_trip():
    """Samples cross processes as two tensors and come back exactly (log-probs are float32 values,
    exact in float64)."""
    from repro.pipelinerl.actor import Sample
    from repro.pipelinerl.channel import pack_json, pack_samples, unpack_json, unpack_samples

    lp = torch.randn(7).float().tolist()
    samples = [
        Sample(3, [11, 4, 2, 10], [2, 4, 12], lp[:3], [0, 8, 8], 1.0, actor=1),
        Sample(9, [11, 7, 10], [], [], [], 0.0, actor=0, truncated=True),
        Sample(4, [11, 1, 10], [1, 5, 9, 12], lp[3:], [16, 16, 24, 24], 0.0, actor=2),
    ]
    back = unpack_samples(*pack_samples(samples))
    for a, b in zip(samples, back, strict=True):
        assert (a.index, a.prompt, a.tokens, a.logprobs, a.versions, a.reward, a.actor, a.truncated) == (
            b.index, b.prompt, b.tokens, b.logprobs, b.versions, b.reward, b.actor, b.truncated
        )  # fmt: skip
    assert unpack_samples(*pack_samples([])) == []
    assert unpack_json(pack_json({"a": [1, 2], "b": "x"})) == {"a": [1, 2], "b": "x"}
    bad = copy.deepcopy(samples[0])
    bad.versions = bad.versions[:-1]
    with pytest.raises(ValueError, match=r"sample 3 has 3 tokens, 3 log-probs and 2 versions"):
        pack_samples([bad])


@pytest.mark.gpu
@pytest.mark.claim("pipelinerl/disjoint-devices", section=SECTION)
def test_gpu_launch_one_process_per_gpu(weights_file, tmp_path):
    """The same job on two GPUs with NCCL (weights broadcast into the engine's flat buffer, CUDA
    graphs): every mode trains its steps with the bookkeeping and accounting intact."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    if sanitizing():  # child processes of torchrun: nothing of ours for memcheck to instrument here
        pytest.skip("not under compute-sanitizer: the job runs in torchrun's child processes")
    out = tmp_path / "launch-1+1.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "1", "-m", "repro.pipelinerl.launch", "--device", "cuda", *LAUNCH, "--trainers",
           "1", "--modes", ",".join(MODES), "--steps", "20", "--max-lag", "24", "--time-per-mode", "60", "--weights", str(weights_file),
           "--stall-s", "60", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'site'}{os.pathsep}{ROOT}", "NCCL_NVLS_ENABLE": "0",
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")}  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["backend"] == "nccl"
    for mode in MODES:
        res = doc["modes"][mode]
        assert res["summary"]["steps"] == 20 and res["accounting"]["ok"] and res["version_check"] == "ok"
    assert doc["modes"]["pipeline"]["summary"]["mixed_version_samples"] > 0
