"""Train from a Hugging Face folder under several layouts in one torchrun job (tests/test_runtime_hf_init.py).

For each layout rank 0 writes: the step-0 weights' largest difference from the folder's (gathered from
the shards each rank read), the elements every rank read from the files and the parameter elements it
holds, and the losses of the steps that follow. With --save, the first layout's step-0 weights are also
written as a trainscale model folder (for `export --to hf`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from trainscale.runtime.artifact import save_model_dir
from trainscale.runtime.hf_init import load_hf_init
from trainscale.runtime.init import resolved_config
from trainscale.runtime.model import build_model
from trainscale.runtime.parallel.mesh import exit_rank
from trainscale.runtime.train import Trainer
from trainscale.specs import Layout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="a config, or several ';'-separated (results keyed "
                    "'CONFIG_STEM:LAYOUT' then)")
    ap.add_argument("--layouts", required=True, help="';'-separated layout strings")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--result", required=True)
    ap.add_argument("--save", default=None, help="folder for the first layout's step-0 weights (with several "
                    "configs: a folder per config under it, after the last layout's steps)")
    args = ap.parse_args()
    configs = args.config.split(";")
    out: dict[str, object] = {}
    for path in configs:
        run_config(path, args, out, many=len(configs) > 1)
    dist.destroy_process_group()


def run_config(path: str, args: argparse.Namespace, out: dict[str, object], many: bool) -> None:
    cfg = resolved_config(path)
    stem = Path(path).stem
    layouts = args.layouts.split(";")
    for i, text in enumerate(layouts):
        trainer = Trainer(cfg, Layout.parse(text), out=None, log=lambda _m: None)
        counts = torch.tensor([trainer.init_elements_read, trainer.local_params()], dtype=torch.int64)
        every = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
        dist.all_gather(every, counts)
        state = trainer.full_state_dict()
        diff = None
        if dist.get_rank() == 0:
            ref = build_model(cfg.model, "meta")
            ref.to_empty(device="cpu")
            load_hf_init([ref], cfg.init, cfg.model)  # the whole folder, one process: the reference
            diff = max((state[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
            assert set(state) == {n for n, _ in ref.named_parameters()}
            if i == 0 and args.save and not many:
                save_model_dir(args.save, state, cfg.model, trainer.corpus.tokenizer_path)
        res = trainer.run(args.steps)
        out[f"{stem}:{text}" if many else text] = {
            "losses": res.losses, "grad_norms": [m.get("grad_norm") for m in res.metrics], "step0_max_diff": diff,
            "read": [int(c[0]) for c in every],
            "local_params": [int(c[1]) for c in every]}
        if many and args.save and i == len(layouts) - 1:  # the trained weights, for export
            state = trainer.full_state_dict()
            if dist.get_rank() == 0:
                save_model_dir(Path(args.save) / stem, state, cfg.model, trainer.corpus.tokenizer_path)
        if dist.get_rank() == 0:
            with open(args.result, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
    exit_rank(0)  # the job is done; no finalization with many layouts' gloo groups alive (mesh.exit_rank)
