"""The corpus, the training command and the benchmark, end to end on a CPU at smoke size."""

from __future__ import annotations

import json

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from repro.dflash import generate, speculative_generate
from repro.dflash.data import decode, encode, is_heldout, load_corpus, stdlib_files


@settings(max_examples=30, deadline=None)
@given(data=st.binary(max_size=64))
def test_byte_tokenizer_round_trip(data):
    ids = encode(data)
    assert ids.dtype == torch.int64 and ids.numel() == len(data)
    assert bytes(ids.tolist()) == data
    assert decode(ids) == data.decode("utf-8", errors="replace")


def test_corpus_is_deterministic_and_split():
    a, b = load_corpus(20_000), load_corpus(20_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)
    assert a.train.numel() == 20_000 and a.heldout.numel() > 0
    files = stdlib_files()
    held = [f for f in files if is_heldout(f.name)]
    assert 0 < len(held) < len(files)


def test_train_command_saves_loadable_models(tmp_path):
    from repro.dflash.train import load, main

    main(["--config", "tiny", "--out", str(tmp_path), "--max-steps", "3", "--device", "cpu"])
    target, drafter, ar = load(tmp_path)
    prompt = encode("def f(x):\n    return ")
    ref = generate(target, prompt, 6)
    for model in (drafter, ar):
        assert torch.equal(speculative_generate(target, model, prompt, 6, block_size=4).tokens, ref)


def test_bench_smoke_on_cpu(tmp_path):
    """The benchmark runs through on a CPU (tiny models, few steps) and writes a report whose
    speculative rows (DFlash, EAGLE-style, AR) passed the greedy-equality check, with drafting costs
    and equal-cost rows against both baselines.

    Asserts only what a fixed amount of work gives whatever the machine's speed: which drafter a
    timed cost picks may change, that each DFlash block is paired with some baseline block may not."""
    from repro.dflash.bench import main

    # a budget no machine reaches: the CPU smoke run does a fixed amount of work (its step counts,
    # one round), where a 60 s budget cut training and skipped temperature 1 on a busy machine; one
    # thread, since on a busy machine two waiting on each other took 94 s against 13 s
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = main(["--out", str(tmp_path), "--budget-s", "100000", "--quick"])
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(path.read_text())
    impls = ("dflash", "eagle", "ar", "target")
    rows = [r for r in doc["rows"] if r["impl"] in impls]
    assert rows and all(r["check"] == "ok" for r in rows)
    # every candidate in both modes at both temperatures: nothing was skipped for time
    assert {(r["impl"], r["mode"], r["temperature"]) for r in rows} == {
        (i, m, t) for i in impls for m in ("eager", "graphs") for t in (0.0, 1.0)
    }
    assert all(r["tau"] >= 1 for r in rows if r["temperature"] == 0.0)
    # drafting cost per round on the eager rows, and the equal-cost comparisons built from it
    assert all(r["draft_ms"] > 0 for r in rows if r["impl"] != "target" and r["mode"] == "eager")
    for base in ("eagle", "ar"):
        pairs = [r for r in doc["rows"] if r["impl"] == f"{base}_at_dflash_cost"]
        assert {r["temperature"] for r in pairs} == {0.0, 1.0}
        assert all(r[f"{base}_block"] is not None and r["tau"] is not None for r in pairs)
