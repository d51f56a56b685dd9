#!/usr/bin/env python3
"""The PyTorch side of `bench-harness --baseline pytorch`: one model configuration, one policy,
measured the way the harness measures ours, printed as one JSON line.

The models are PyTorch's own at the harness's sizes: torchvision's ResNet-50/152, Hugging Face
`transformers`' BertForMaskedLM and GPT2LMHeadModel (eager attention) and LlamaForCausalLM at
SmolLM2-135M's shape (sdpa attention, transformers' default), and a 3D U-Net written with
`torch.nn` to match `trainers/unet3d`. Each is cut into the same stages as our stage graph, and
`--segments` (from the harness: the stage ranges our policy chose) says which run under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: every segment but the last, as our
executor does. A `--policy` with `+keep=` (our selective recompute) runs those segments under
PyTorch's selective activation checkpointing, saving the outputs of the ops it names: `matmul` the
linear layers' products (`aten.mm`, `aten.addmm`), `conv` the convolutions (`aten.convolution`),
`attention` the product of the probabilities with the values (the `aten.bmm` whose output is not
the (T, T) scores). The `-lora` models are the same under `peft`'s LoRA (rank 8, alpha 16, B drawn; SmolLM2's
rank 16, alpha 32, on all seven projections), the base frozen. Optimizers as ours: SGD with momentum 0.9 (lr 0.05, weight decay 1e-4) for ResNet,
AdamW (lr 1e-4, weight decay 0.01) for the others. fp32, `--threads` intra-op threads, on
`--device` (`cpu` or `cuda`: every tensor made on it, the inputs drawn by a generator there).

Measured like our columns:
- step time: median (min, max) of `--steps` steps after one warm-up step, without the profiler
  (on CUDA, between synchronisations);
- model state: parameters plus optimizer state, in bytes of tensor storage;
- step peak: the highest live tensor bytes during one more step (forward, backward, optimizer),
  above what was live when it started (parameters and optimizer state: gradients are set to None
  between steps), from the profiler's allocation events (`profile_memory=True`; on CUDA,
  `torch.cuda.max_memory_allocated` over the step);
- forward/backward peak: the same, up to the optimizer's update;
- step FLOPs (in the run without checkpoints only): one forward and backward under
  `FlopCounterMode` (the shapes of its products and convolutions), for both sides' achieved
  GFLOP/s under every policy, and torch.mm's best rate.

Usage (the harness runs it; by hand):
    python3 scripts/torch_baseline.py --model resnet50 --batch 8 --input-size 128 --segments 0:19
Needs torch (and torchvision, transformers; peft for the `-lora` models);
`pip install torch torchvision transformers peft`.
"""

import argparse
import resource
import json
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import FlopCounterMode


class Stage:
    """One stage of the graph: `fn(*inputs)` on the values `inputs`, producing value `output`."""

    def __init__(self, fn, inputs):
        self.fn, self.inputs = fn, inputs


def resnet(preset, batch, size):
    import torchvision

    model = getattr(torchvision.models, preset)(num_classes=10)
    stem = nn.Sequential(model.conv1, model.bn1, model.relu)
    blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]

    def head(x, labels):
        return F.cross_entropy(model.fc(torch.flatten(model.avgpool(x), 1)), labels)

    # Values: 0 images, 1 labels, then one per stage.
    fns = [stem, model.maxpool, *blocks]
    stages = [Stage(f, [0] if i == 0 else [i + 1]) for i, f in enumerate(fns)]
    stages.append(Stage(head, [len(fns) + 1, 1]))

    def inputs(gen):
        return [torch.randn(batch, 3, size, size, generator=gen), torch.randint(0, 10, (batch,), generator=gen)]

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return model, stages, 2, inputs, opt


def hidden(out):
    """A `transformers` layer's hidden states, whether it returns a tuple or the tensor."""
    return out[0] if isinstance(out, tuple) else out


def transformer_stages(embed, blocks, head, n_inputs):
    """Embedding, blocks, head: values 0..n_inputs-1 are the batch, then one per stage."""
    stages = [Stage(embed, [0])]
    stages += [Stage(b, [n_inputs + i]) for i, b in enumerate(blocks)]
    stages.append(Stage(head, [n_inputs + len(blocks)] + list(range(1, n_inputs))))
    return stages


def gpt2(batch, seq):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(attn_implementation="eager"))
    model.config._attn_implementation = "eager"
    t = model.transformer
    positions = torch.arange(seq)

    def embed(ids):
        return t.drop(t.wte(ids) + t.wpe(positions))

    # Blocks called one by one get no mask from the model: pass the causal one (additive).
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]

    def block(b):
        return lambda x: hidden(b(x, attention_mask=causal))

    def head(x, targets):
        logits = model.lm_head(t.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    stages = transformer_stages(embed, [block(b) for b in t.h], head, 2)
    vocab = model.config.vocab_size

    def inputs(gen):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return [ids[:, :-1], ids[:, 1:]]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return model, stages, 2, inputs, opt


def bert(batch, seq):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
    config._attn_implementation = "eager"
    model = BertForMaskedLM(config)
    enc = model.bert

    def embed(ids):
        return enc.embeddings(input_ids=ids)

    def layer_fn(layer):
        return lambda x: hidden(layer(x))

    def head(x, labels):
        scores = model.cls(x)
        return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), labels.reshape(-1), ignore_index=-100)

    stages = transformer_stages(embed, [layer_fn(l) for l in enc.encoder.layer], head, 2)

    def inputs(gen):
        ids = torch.randint(1000, config.vocab_size, (batch, seq), generator=gen)
        chosen = torch.rand(batch, seq, generator=gen) < 0.15
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        return [torch.where(chosen, torch.full_like(ids, 103), ids), labels]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return model, stages, 2, inputs, opt


class ConvNormRelu(nn.Sequential):
    def __init__(self, c_in, c_out):
        super().__init__(nn.Conv3d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm3d(c_out), nn.ReLU(inplace=True))


class Level(nn.Module):
    """Two conv-norm-ReLU; a decoder level first up-convolves and concatenates the skip."""

    def __init__(self, c_in, c_mid, c_out, skip=None):
        super().__init__()
        self.up = nn.ConvTranspose3d(c_in, c_in, 2, stride=2) if skip is not None else None
        self.convs = nn.Sequential(ConvNormRelu(c_in + (skip or 0), c_mid), ConvNormRelu(c_mid, c_out))

    def forward(self, x, skip=None):
        if self.up is not None:
            x = torch.cat([skip, self.up(x)], 1)
        return self.convs(x)


def unet3d(batch, side, base, levels=3, classes=3):
    """`unet3d::Config`'s `small` (base 16) or `cicek` (base 32) preset, stage for stage as
    `UNet3d::new` builds its graph."""
    mods, stages = nn.ModuleList(), []

    def add(fn, inputs):
        stages.append(Stage(fn, inputs))
        return 1 + len(stages)  # values 0: volume, 1: labels

    x, c, skips = 0, 1, []
    for l in range(levels):
        mods.append(Level(c, base << l, base << (l + 1)))
        skip = add(mods[-1], [x])
        skips.append((skip, base << (l + 1)))
        x = add(lambda t: F.max_pool3d(t, 2), [skip])
        c = base << (l + 1)
    mods.append(Level(c, c, 2 * c))
    x = add(mods[-1], [x])
    c *= 2
    for l in reversed(range(levels)):
        skip, c_skip = skips[l]
        mods.append(Level(c, c_skip, c_skip, skip=c_skip))
        x = add(mods[-1], [x, skip])
        c = c_skip
    mods.append(nn.Conv3d(c, classes, 1))
    head_conv = mods[-1]
    add(lambda t, labels: F.cross_entropy(head_conv(t), labels), [x, 1])

    def inputs(gen):
        return [torch.randn(batch, 1, side, side, side, generator=gen), torch.randint(0, classes, (batch, side, side, side), generator=gen)]

    opt = torch.optim.AdamW(mods.parameters(), lr=1e-4, weight_decay=0.01)
    return mods, stages, 2, inputs, opt


def smollm2(batch, seq):
    """SmolLM2-135M's published shape (`LlamaForCausalLM`), random weights, `transformers`' default
    attention (sdpa: causal, no mask, the grouped key/value heads as transformers passes them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    m = model.model
    positions = torch.arange(seq)[None]
    # One (cos, sin) table for every layer, as LlamaModel computes it once per forward.
    with torch.no_grad():
        rotary = m.rotary_emb(torch.zeros(1), position_ids=positions)

    def layer(block):
        return lambda x: hidden(block(x, attention_mask=None, position_ids=positions, position_embeddings=rotary))

    def head(x, targets):
        logits = model.lm_head(m.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    stages = transformer_stages(m.embed_tokens, [layer(b) for b in m.layers], head, 2)

    def inputs(gen):
        ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
        return [ids[:, :-1], ids[:, 1:]]

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return model, stages, 2, inputs, opt


LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(built, targets, fan_in_fan_out, rank=8):
    """A built model under `peft`'s LoRA as the harness's `-lora` models are (rank 8, or `rank`;
    alpha twice the rank; no dropout; B drawn: `init_lora_weights=False`), base frozen, AdamW over
    the adapters. PEFT swaps the targeted layers inside the same modules, so the stages call the
    adapted layers."""
    from peft import LoraConfig, get_peft_model

    model, stages, n_inputs, inputs, _ = built
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, fan_in_fan_out=fan_in_fan_out, init_lora_weights=False)
    model = get_peft_model(model, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
    return model, stages, n_inputs, inputs, opt


def build(model, batch, size):
    if model == "gpt2-small-lora":
        return with_lora(gpt2(batch, size), ["c_attn", "c_proj", "c_fc"], True)
    if model == "bert-large-lora":
        return with_lora(bert(batch, size), ["query", "key", "value", "dense"], False)
    if model == "smollm2-135m":
        return smollm2(batch, size)
    if model == "smollm2-135m-lora":
        return with_lora(smollm2(batch, size), LLAMA_TARGETS, False, rank=16)
    if model in ("resnet50", "resnet152"):
        return resnet(model, batch, size)
    if model == "gpt2-small":
        return gpt2(batch, size)
    if model == "bert-large":
        return bert(batch, size)
    if model in ("unet3d-small", "unet3d-cicek"):
        return unet3d(batch, size, base=16 if model == "unet3d-small" else 32)
    sys.exit(f"torch_baseline: no PyTorch version of `{model}`; valid models: resnet50, resnet152, bert-large, unet3d-small, unet3d-cicek, gpt2-small, bert-large-lora, gpt2-small-lora, smollm2-135m, smollm2-135m-lora")


def kept(policy):
    """`checkpoint`'s `context_fn` for a policy with `+keep=`: selective activation checkpointing
    that saves the outputs of the ops named and recomputes the rest; None without `+keep=`."""
    if "+keep=" not in policy:
        return None
    kinds = set(policy.split("+keep=", 1)[1].replace(",", "+").split("+"))
    aten = torch.ops.aten
    unknown = kinds - {"matmul", "conv", "attention"}
    if unknown:
        sys.exit(f"torch_baseline: unknown op kinds to keep {sorted(unknown)}; valid kinds: matmul, conv, attention")

    def save(op, args):
        if op in (aten.mm.default, aten.addmm.default):
            return "matmul" in kinds
        if op == aten.convolution.default:
            return "conv" in kinds
        if op == aten.bmm.default:
            # (BH, T, T) @ (BH, T, hd) is attention's output; (BH, T, hd) @ (BH, hd, T) its scores.
            scores = args[1].shape[-1] == args[0].shape[-2]
            return "attention" in kinds and not scores
        return False

    def policy_fn(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if save(op, args) else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy_fn)


def forward(stages, n_inputs, segments, batch_values, context_fn=None):
    """The loss, every segment but the last under `checkpoint` (selective with `context_fn`), as
    our executor runs it."""
    values = dict(enumerate(batch_values))
    last_use = {}
    for i, s in enumerate(stages):
        for v in s.inputs:
            last_use[v] = i
    for k, (a, b) in enumerate(segments):
        produced = set(range(n_inputs + a, n_inputs + b))
        seg_in = sorted({v for s in stages[a:b] for v in s.inputs} - produced)
        seg_out = sorted(v for v in produced if last_use.get(v, -1) >= b)

        def run(*ins, a=a, b=b, seg_in=seg_in, seg_out=seg_out):
            local = dict(zip(seg_in, ins))
            for i in range(a, b):
                local[n_inputs + i] = stages[i].fn(*[local[v] for v in stages[i].inputs])
            return tuple(local[v] for v in seg_out) if seg_out else local[n_inputs + b - 1]

        ins = [values[v] for v in seg_in]
        if k == len(segments) - 1:
            return run(*ins)
        extra = {"context_fn": context_fn} if context_fn else {}
        outs = checkpoint(run, *ins, use_reentrant=False, **extra)
        values.update(zip(seg_out, outs))
        for v in seg_in:  # drop what no later segment reads
            if last_use.get(v, -1) < b:
                values.pop(v, None)


def step(model, stages, n_inputs, segments, batch_values, opt, context_fn=None, before_update=None, loss_of=None):
    loss = loss_of(batch_values) if loss_of else forward(stages, n_inputs, segments, batch_values, context_fn)
    loss.backward()
    if before_update:
        before_update()
    with torch.profiler.record_function("optimizer"):
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def step_flops(stages, n_inputs, batch_values, opt):
    """One step's forward and backward FLOPs without recompute (one segment), as
    FlopCounterMode counts them from the shapes of the products and convolutions; no update."""
    with FlopCounterMode(display=False) as counter:
        forward(stages, n_inputs, [(0, len(stages))], batch_values).backward()
    opt.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def mm_peak_gflops():
    """torch.mm's best rate here: a (2048, 2048) @ (2048, 2048) f32 product, the fastest of five
    after a warm-up (the harness measures its own matrix product the same way)."""
    a = torch.rand(2048, 2048)
    times = []
    for _ in range(6):
        sync()
        t0 = time.perf_counter()
        torch.mm(a, a)
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * 2048**3 / min(times[1:]) / 1e9


def state_bytes(model, opt):
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    moments = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    return params + buffers + moments


def sync():
    """Waits for the device's queued work (CUDA runs asynchronously)."""
    if torch.cuda.is_available() and torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()


def cuda_peaks(run_step):
    """Peak allocated bytes above the start of `run_step(before_update)`, over the whole step and
    before the optimizer, from CUDA's allocator statistics."""
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd = []
    run_step(lambda: (sync(), fwd_bwd.append(torch.cuda.max_memory_allocated() - base)))
    sync()
    return torch.cuda.max_memory_allocated() - base, fwd_bwd[0]


def measured_peaks(prof):
    """Peak live bytes above the start, over the whole step and before the optimizer."""
    events = list(prof.profiler.kineto_results.events())
    opt_start = min((e.start_ns() for e in events if e.name() == "optimizer"), default=None)
    live = peak = fwd_bwd = 0
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
        if opt_start is None or e.start_ns() < opt_start:
            fwd_bwd = max(fwd_bwd, live)
    return peak, fwd_bwd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--policy", default="off", help="recorded, and its +keep= applied: --segments says where the checkpoints are")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--input-size", type=int, required=True, help="sequence length, image or volume side")
    ap.add_argument("--segments", required=True, help="stage ranges start:end, comma-separated, e.g. 0:5,5:19")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--time-only", action="store_true", help="time the steps only, no profiled step for memory (peaks 0): the harness's interleaved timing rounds")
    ap.add_argument("--memory-limit", type=int, help="bytes this process may allocate (RLIMIT_DATA): beyond them an allocation fails, and the run exits saying 'out of memory: ...'")
    ap.add_argument("--compile", action="store_true", help="the whole model's loss through torch.compile (inductor), no torch.utils.checkpoint: its partitioner decides what to save")
    ap.add_argument("--memory-budget", type=float, default=1.0, help="with --compile: torch._functorch.config.activation_memory_budget (0 to 1), the share of the activations the compiled backward may keep")
    a = ap.parse_args()
    if a.compile and not 0.0 <= a.memory_budget <= 1.0:
        sys.exit(f"torch_baseline: --memory-budget {a.memory_budget} is not between 0 and 1")
    if a.memory_limit:
        resource.setrlimit(resource.RLIMIT_DATA, (a.memory_limit, a.memory_limit))
    try:
        run(a)
    except (RuntimeError, MemoryError) as e:
        if a.memory_limit and ("can't allocate memory" in str(e) or isinstance(e, MemoryError)):
            sys.exit(f"out of memory: the step does not fit in --memory-limit {a.memory_limit} bytes ({str(e).splitlines()[0][:200]})")
        if isinstance(e, torch.OutOfMemoryError):
            sys.exit(f"out of memory: the step does not fit on {a.device} ({str(e).splitlines()[0][:200]})")
        raise


def run(a):
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    # Every tensor the models and stages make (weights, positions, masks) on the device.
    torch.set_default_device(a.device)
    cuda = torch.device(a.device).type == "cuda"
    model, stages, n_inputs, make_inputs, opt = build(a.model, a.batch, a.input_size)
    segments = [tuple(int(x) for x in r.split(":")) for r in a.segments.split(",")]
    context_fn = kept(a.policy)
    if segments[0][0] != 0 or segments[-1][1] != len(stages) or any(p[1] != q[0] for p, q in zip(segments, segments[1:])):
        sys.exit(f"torch_baseline: --segments {a.segments} does not cover the {len(stages)} stages of {a.model} in order")
    model.train()
    loss_of = None
    if a.compile:
        # Compiled: the whole graph one function, the partitioner's choice of what to save
        # within the budget instead of our segments.
        torch._functorch.config.activation_memory_budget = a.memory_budget
        # Compiled from scratch in a measuring run: its compile time is the first run's a user
        # meets. A timing round (--time-only) measures no compile time: the cache may serve it.
        torch._inductor.config.force_disable_caches = not a.time_only
        segments = [(0, len(stages))]
        whole = torch.compile(lambda *values: forward(stages, n_inputs, segments, values))
        loss_of = lambda values: whole(*values)
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    times = []
    first_ms = None
    for i in range(a.steps + 1):
        batch_values = make_inputs(gen)
        sync()
        t0 = time.perf_counter()
        loss = step(model, stages, n_inputs, segments, batch_values, opt, context_fn, loss_of=loss_of)
        sync()
        if i > 0:  # the first step is a warm-up, and creates the optimizer state
            times.append((time.perf_counter() - t0) * 1e3)
        else:
            first_ms = (time.perf_counter() - t0) * 1e3
    model_state = state_bytes(model, opt)
    peak, fwd_bwd = 0, 0
    if not a.time_only and cuda:
        batch_values = make_inputs(gen)
        peak, fwd_bwd = cuda_peaks(lambda before_update: step(model, stages, n_inputs, segments, batch_values, opt, context_fn, before_update, loss_of))
    elif not a.time_only:
        batch_values = make_inputs(gen)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            step(model, stages, n_inputs, segments, batch_values, opt, context_fn, loss_of=loss_of)
        peak, fwd_bwd = measured_peaks(prof)
    # Counted once per model, in the run without checkpoints (`off`): the count is the same for
    # every policy, and that run's memory is known to fit.
    counts = not a.time_only and len(segments) == 1 and not a.compile
    flops = step_flops(stages, n_inputs, make_inputs(gen), opt) if counts else None
    mm_peak = mm_peak_gflops() if counts else None
    print(json.dumps({
        "framework": "pytorch-compile" if a.compile else "pytorch",
        "framework_version": torch.__version__,
        "model": a.model,
        "policy": a.policy,
        "batch": a.batch,
        "threads": a.threads,
        "segments": len(segments),
        "model_state_bytes": model_state,
        "step_peak_bytes": peak,
        "fwd_bwd_peak_bytes": fwd_bwd,
        "step_ms_median": statistics.median(times),
        "step_ms_min": min(times),
        "step_ms_max": max(times),
        "timed_steps": len(times),
        "loss": loss,
        "step_flops": flops,
        "mm_peak_gflops": mm_peak,
        # The first step's time beyond a step's: compiling (forward and backward graphs).
        "compile_ms": first_ms - statistics.median(times) if a.compile else None,
        "memory_budget": a.memory_budget if a.compile else None,
    }))


if __name__ == "__main__":
    main()
