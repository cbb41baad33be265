"""The walkthrough's tiny models, trained once by this script and committed beside it.

The walkthrough must run in seconds on any CPU, also a busy two-core one, where training even the
``tiny`` models takes minutes. So this script trains them (the ``tiny`` config of
:mod:`repro.dflash.train`, a little shorter) and saves their weights in half precision to
``walkthrough_weights.pt`` (about 0.4 MB); the notebook only loads them::

    python -m repro.dflash.walkthrough_weights          # about a minute on a laptop CPU

Run it again after changing :mod:`repro.dflash.model` in a way that changes the parameters'
names or shapes (:func:`load_walkthrough_models` then says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
from pathlib import Path

import torch

from repro.dflash.data import load_corpus
from repro.dflash.model import DFlashDrafter, DrafterConfig, Target, TargetConfig
from repro.dflash.train import CONFIGS, TrainConfig, train_all

WEIGHTS = Path(__file__).with_name("walkthrough_weights.pt")
# the tiny config, with the steps the walkthrough used to train live
CONFIG: TrainConfig = dataclasses.replace(
    CONFIGS["tiny"], seq_len=64, target_steps=120, drafter_steps=150, ar_steps=60, n_anchors=16
)


def _half(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # fp16 halves the file; the models run in fp32 after loading (fp16 rounding of weights this
    # small changes a logit by ~1e-3, far below the gaps that decide an argmax in the walkthrough)
    return {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}


def make(path: Path = WEIGHTS, seed: int = 0) -> dict:
    """Train the three models with :data:`CONFIG` and save them to ``path``; returns the saved log."""
    torch.manual_seed(seed)
    corpus = load_corpus(CONFIG.corpus_bytes)
    target, drafter, ar, _, log = train_all(CONFIG, "cpu", seed=seed, corpus=corpus, show=False)
    drafter_cfg = dataclasses.asdict(drafter.cfg)
    drafter_cfg["feature_layers"] = list(drafter.feature_layers)
    info = {
        "steps": log.steps,
        "loss": log.loss,
        "seed": seed,
        "corpus": corpus.describe(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
    }
    torch.save(
        {
            "target": {"config": dataclasses.asdict(target.cfg), "state": _half(target)},
            "dflash": {"config": drafter_cfg, "state": _half(drafter)},
            "ar": {"config": dataclasses.asdict(ar.cfg), "state": _half(ar)},
            "info": info,
        },
        path,
    )
    return info


def load_walkthrough_models(path: Path = WEIGHTS) -> tuple[Target, DFlashDrafter, Target, dict]:
    """(target, DFlash drafter, autoregressive drafter, training info), fp32, in eval mode."""
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: make it with 'python -m repro.dflash.walkthrough_weights'"
        )
    saved = torch.load(path, map_location="cpu", weights_only=True)

    def restore(model: torch.nn.Module, state: dict) -> torch.nn.Module:
        try:
            model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        except RuntimeError as exc:
            raise RuntimeError(
                f"{path.name} no longer matches repro/dflash/model.py ({str(exc).splitlines()[0]}); "
                "remake it with 'python -m repro.dflash.walkthrough_weights'"
            ) from None
        return model.eval().requires_grad_(False)

    target = restore(Target(TargetConfig(**saved["target"]["config"])), saved["target"]["state"])
    dcfg = dict(saved["dflash"]["config"])
    dcfg["feature_layers"] = tuple(dcfg["feature_layers"])
    drafter = restore(DFlashDrafter(target, DrafterConfig(**dcfg)), saved["dflash"]["state"])
    ar = restore(Target(TargetConfig(**saved["ar"]["config"])), saved["ar"]["state"])
    return target, drafter, ar, saved["info"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=WEIGHTS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    info = make(args.out, args.seed)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.2f} MB): {info}", file=sys.stderr)


if __name__ == "__main__":
    main()
