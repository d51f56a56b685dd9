#!/usr/bin/env python3
"""What PyTorch's autograd keeps for backward, stage by stage: the yardstick for `train-* --dry-run`'s
`keeps` column (what each of our stages keeps), on the models and stages of `torch_baseline.py`.

Each stage runs once, in order, under `torch.autograd.graph.saved_tensors_hooks`; a stage's figure
is the bytes of the distinct storages its ops save that no earlier stage saved, that are not its
inputs and not parameters (a saved weight costs nothing extra). In-place ReLUs share storage with
what they overwrite, so a conv + BatchNorm + ReLU counts the convolution's output and the ReLU's.

Usage:
    python3 scripts/torch_saved.py --model unet3d-small --batch 2 --input-size 32
    python3 scripts/torch_saved.py --model resnet50 --batch 8 --input-size 128
"""

import argparse

import torch

import torch_baseline


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="resnet50, resnet152, bert-large, unet3d-small, gpt2-small")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--input-size", type=int, required=True, help="image side, volume side or sequence length")
    a = ap.parse_args()
    torch.manual_seed(0)
    model, stages, _, inputs, _ = torch_baseline.build(a.model, a.batch, a.input_size)
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    values = list(inputs(torch.Generator().manual_seed(0)))
    total = 0
    print(f"{'#':>3}  {'keeps':>10}")
    for i, stage in enumerate(stages):
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = stage.fn(*[values[v] for v in stage.inputs])
        own_inputs = {values[v].untyped_storage().data_ptr() for v in stage.inputs}
        keeps = sum(n for ptr, n in saved.items() if ptr not in own_inputs)
        seen |= set(saved)
        total += keeps
        print(f"{i:3}  {keeps / 2**20:6.1f} MiB")
        values.append(out)
    print(f"all  {total / 2**20:6.1f} MiB")


if __name__ == "__main__":
    main()
