"""PyTorch's side of the kernel benchmarks, at the shapes and thread count ours run them:

- `torch.mm` at the shapes of `crates/ops/benches/gemm.rs` (GFLOP/s, each operand row-major),
- the convolutions of `crates/ops/benches/fused.rs` (one forward and backward of the sum of the
  output, the same step the Rust bench times), as medians in ms;
- with `--convs FILE`, instead, the convolutions listed there (`bench-harness kernels` writes
  the list it recorded from the models): each one's forward, input-gradient backward (where the
  model needs it) and weight-gradient backward, as medians in ms, one JSON line per convolution.

    python scripts/torch_ops.py [--threads 2] [--convs FILE --reps 9]

Run it right after `cargo bench -p ops --bench gemm` / `--bench fused -- conv`, on the same
machine: timings move between machines and, on a shared host, between minutes.
"""

import argparse
import json
import statistics
import time

import torch

# (what, m, k, n), as in benches/gemm.rs.
SHAPES = [
    ("resnet50 3x3 stage 1, 3 images", 64, 576, 3072),
    ("resnet50 3x3 stage 1, 3 images, pixels first", 3072, 576, 64),
    ("resnet50 1x1 256->64, 1 image", 64, 256, 1024),
    ("resnet50 3x3 stage 4, 8 images", 512, 4608, 128),
    ("unet3d 3x3x3 32->32, 2 slices", 32, 864, 2048),
    ("unet3d 3x3x3 32->32, 2 slices, voxels first", 2048, 864, 32),
    ("unet3d 3x3x3 32->32 weight gradient", 32, 2048, 864),
    ("gpt2 qkv, 2 x 256 tokens", 512, 768, 2304),
    ("bert-large intermediate, 2 x 128 tokens", 256, 1024, 4096),
    ("smollm2 q and o, 2 x 512 tokens", 1024, 576, 576),
    ("smollm2 gate and up, 2 x 512 tokens", 1024, 576, 1536),
    ("smollm2 down, 2 x 512 tokens", 1024, 1536, 576),
    ("smollm2 down weight gradient", 576, 1024, 1536),
    ("smollm2 head, 2 x 512 tokens", 1024, 576, 49152),
]

# (what, input shape, weight shape, padding, stride), as in benches/fused.rs.
CONVS = [
    ("conv2d 7x7/2 (8, 3, 128, 128) -> 64", (8, 3, 128, 128), (64, 3, 7, 7), 3, 2),
    ("conv2d 3x3 (8, 64, 32, 32) -> 64", (8, 64, 32, 32), (64, 64, 3, 3), 1, 1),
    ("conv2d 3x3 (8, 512, 4, 4) -> 512", (8, 512, 4, 4), (512, 512, 3, 3), 1, 1),
    ("conv2d 1x1 (8, 256, 32, 32) -> 64", (8, 256, 32, 32), (64, 256, 1, 1), 0, 1),
    ("conv3d 3x3x3 (2, 32, 32, 32, 32) -> 32", (2, 32, 32, 32, 32), (32, 32, 3, 3, 3), 1, 1),
]


def median_seconds(f, reps, setup=lambda: None):
    """The median time of `reps` calls of `f` after two not counted, each after `setup` (not
    timed)."""
    for _ in range(2):
        setup()
        f()
    times = []
    for _ in range(reps):
        setup()
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def conv_op(kind, geometry):
    """The PyTorch op a model runs for a recorded convolution `kind` with `geometry` (stride in
    depth, stride in-plane, padding in depth, padding in-plane)."""
    sd, shw, pd, phw = geometry
    f = torch.nn.functional
    if kind == "conv2d":
        return lambda x, w: f.conv2d(x, w, padding=phw, stride=shw)
    if kind == "conv3d":
        return lambda x, w: f.conv3d(x, w, padding=(pd, phw, phw), stride=(sd, shw, shw))
    if kind == "conv3d-concat":
        # A U-Net decoder in PyTorch concatenates its skip and up-sampled tensors, then convolves.
        return lambda a, b, w: f.conv3d(
            torch.cat([a, b], 1), w, padding=(pd, phw, phw), stride=(sd, shw, shw)
        )
    if kind == "conv-transpose3d-k2s2":
        return lambda x, w, b: f.conv_transpose3d(x, w, b, stride=2)
    raise SystemExit(f"unknown convolution kind {kind!r}")


def time_convs(path, reps):
    """One JSON line per convolution of the list at `path`: its forward, input-gradient and
    weight-gradient backward times, each alone (only that operand requires a gradient)."""
    with open(path) as f:
        calls = json.load(f)
    for call in calls:
        op = conv_op(call["kind"], call["geometry"])
        data = 2 if call["kind"] == "conv3d-concat" else 1
        operands = [torch.randn(*shape) for shape in call["shapes"]]

        def backward(data_grads):
            ts = [
                t.detach().requires_grad_((i < data) == data_grads)
                for i, t in enumerate(operands)
            ]
            y = op(*ts)
            grad = torch.randn_like(y)

            # Each backward writes a fresh gradient, as ours does, rather than adding into the
            # last one's.
            def clear():
                for t in ts:
                    t.grad = None

            return median_seconds(lambda: y.backward(grad, retain_graph=True), reps, clear) * 1e3

        with torch.no_grad():
            forward = median_seconds(lambda: op(*operands), reps) * 1e3
        times = {
            "forward_ms": forward,
            "input_grad_ms": backward(True) if call["input_gradient"] else None,
            "weight_grad_ms": backward(False),
        }
        print(json.dumps(times), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--convs", help="time the convolutions listed in this JSON file")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.convs:
        time_convs(args.convs, args.reps)
        return
    print(f"torch {torch.__version__}, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for what, m, k, n in SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds = median_seconds(lambda: torch.mm(a, b), 20)
        print(f"torch.mm {what} ({m}, {k}) @ ({k}, {n}): {2 * m * k * n / seconds / 1e9:.1f} GFLOP/s")
    for what, xs, ws, pad, stride in CONVS:
        x = torch.randn(*xs, requires_grad=True)
        w = torch.randn(*ws, requires_grad=True)
        conv = torch.nn.functional.conv3d if len(xs) == 5 else torch.nn.functional.conv2d

        def step():
            conv(x, w, padding=pad, stride=stride).sum().backward()

        print(f"{what}: {median_seconds(step, 10) * 1e3:.1f} ms forward + backward")


if __name__ == "__main__":
    main()
