#!/usr/bin/env python3
"""Reference fixtures from PyTorch for the model tests: an oracle that shares no code with ours.

For a tiny GPT-2 (Hugging Face `transformers`), a tiny BERT masked LM (`transformers`), tiny
decoders of the Llama family (`transformers`' Llama, Mistral, Qwen2 and Qwen3), a tiny
ResNet built from torchvision's own `Bottleneck` blocks, and a tiny 3D U-Net written here with
`torch.nn.functional` to match `trainers/unet3d` (one with BatchNorm and CE + soft Dice, one with
GroupNorm and CE), it writes one safetensors file per model into `trainers/<model>/tests/fixtures/` (and one of
torch.optim.Adafactor's steps into `crates/optim/tests/fixtures/`):

- the weights, the whole state dict as the published checkpoints hold it (tied copies, BatchNorm
  counters), so the test loads them through the model's own snapshot loader, as f32;
- `fixture.*`: the input batch, the evaluation-mode logits, the training-mode loss, the gradient
  of every parameter (`fixture.grad.<our name>`) and, for BatchNorm models, the running statistics
  after the step (`fixture.after.<buffer name>`).

Weights are drawn in f32; everything else is computed in f64 from those exact f32 values and
stored as f32, so the reference carries no f32 rounding of its own beyond the final store.
Dropout is off: a fixture checks the arithmetic, the bit-exactness tests check dropout replay.
The model's configuration travels in the file's metadata (`config`, JSON).

The LoRA fixtures (`gpt2-lora`, `bert-lora`) hold the tiny GPT-2 and BERT under Hugging Face
`peft`'s LoRA: base weights, the adapter as `PeftModel.save_pretrained` writes it (a folder beside
the file), and the adapters' gradients.

Run from the repository root (needs torch, torchvision, transformers, safetensors, peft):

    python3 -m venv .venv-fixtures && .venv-fixtures/bin/pip install torch torchvision transformers safetensors peft
    .venv-fixtures/bin/python scripts/make_fixtures.py            # all; --only lora for the LoRA ones

CI needs no Python: the fixtures are committed (about 5 MB in all).
"""

import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def out_path(crate, name):
    d = os.path.join(ROOT, "crates" if crate == "optim" else "trainers", crate, "tests", "fixtures")
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"{name}.safetensors")


def randomise(model, gen, scale):
    """Every parameter and buffer random, norm weights around 1 and variances positive, so that a
    bias, an affine term or a statistic handled wrongly shows in the outputs. `scale(name, p)`
    sets the other parameters' standard deviation."""
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            for name, p in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
                if not p.is_floating_point():
                    continue
                r = torch.randn(p.shape, generator=gen)
                if isinstance(mod, (nn.LayerNorm, nn.BatchNorm2d)):
                    p.copy_({"weight": 1.0 + 0.2 * r, "bias": 0.1 * r, "running_mean": 0.1 * r,
                             "running_var": 0.5 + torch.rand(p.shape, generator=gen)}[name])
                else:
                    p.copy_(scale(f"{mod_name}.{name}", p) * r)


def f32(t):
    return t.detach().to(torch.float32).contiguous()


def save(path, weights, fixture, config):
    store = lambda v: f32(v) if v.is_floating_point() else v.detach().contiguous()
    tensors = {k: store(v) for k, v in weights.items()}
    tensors.update({f"fixture.{k}": store(v) for k, v in fixture.items()})
    save_file(tensors, path, metadata={"config": json.dumps(config), "generator": "scripts/make_fixtures.py"})
    print(f"{os.path.relpath(path, ROOT)}: {len(tensors)} tensors, {os.path.getsize(path) / 1024:.0f} KiB")


def grads(module, rename):
    return {f"grad.{rename(n)}": p.grad for n, p in module.named_parameters() if p.requires_grad}


LORA = dict(rank=4, alpha=8.0)


def with_lora(model, gen, targets, fan_in_fan_out, adapter_dir):
    """`model` under PEFT's LoRA (rank 4, alpha 8) on `targets`, base frozen, A and B drawn at
    random (PEFT starts B at zero, which would leave A's gradient zero), the adapter saved with
    `save_pretrained` into `adapter_dir` (the test loads PEFT's own files). Returns the model and
    the LoRA configuration for the fixture's metadata."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=targets, fan_in_fan_out=fan_in_fan_out)
    model = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(adapter_dir)
    print(f"{os.path.relpath(adapter_dir, ROOT)}: PEFT adapter")
    return model, dict(LORA, targets=targets)


def peft_name(n):
    """PEFT's in-memory name of an adapter parameter as ours: `base_model.model.transformer.h.0.
    attn.c_attn.lora_A.default.weight` -> `h.0.attn.c_attn.lora_A.weight`."""
    return n.removeprefix("base_model.model.").removeprefix("transformer.").replace(".default.", ".")


def gpt2(gen, lora=False):
    """`lora`: the model under PEFT's LoRA on every projection; the fixture's gradients are the
    adapters' (`gpt2-lora`)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, layer_norm_epsilon=1e-5,
                  embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0)
    model = GPT2LMHeadModel(GPT2Config(activation_function="gelu_new", attn_implementation="eager", bos_token_id=0, eos_token_id=0, **config))
    # Large enough weights that attention is far from uniform: a leaky causal mask or a wrong scale
    # changes the logits well beyond the tolerance.
    randomise(model, gen, lambda n, p: 0.3 if p.dim() == 2 else 0.1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}  # as published: tied head included
    name, rename = "gpt2", lambda n: n.removeprefix("transformer.")
    if lora:
        adapter = os.path.join(os.path.dirname(out_path("gpt2", "gpt2")), "gpt2-lora-adapter")
        model, config["lora"] = with_lora(model, gen, ["c_attn", "c_proj", "c_fc"], True, adapter)
        name, rename = "gpt2-lora", peft_name
    b, t = 2, 16
    ids = torch.randint(0, config["vocab_size"], (b, t), generator=gen)
    targets = torch.randint(0, config["vocab_size"], (b, t), generator=gen)
    model = model.double().train()
    logits = model(ids).logits  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))
    loss.backward()
    fixture = {"ids": ids, "targets": targets, "logits": logits, "loss": loss, **grads(model, rename)}
    save(out_path("gpt2", name), weights, fixture, config)


def bert(gen, lora=False):
    """`lora`: under PEFT's LoRA on the query, key, value and dense layers (`bert-lora`)."""
    from transformers import BertConfig, BertForMaskedLM

    config = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=32, type_vocab_size=2, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, layer_norm_eps=1e-12)
    model = BertForMaskedLM(BertConfig(hidden_act="gelu", attn_implementation="eager", **config))
    randomise(model, gen, lambda n, p: 0.3 if p.dim() == 2 else 0.1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}  # as published: tied decoder included
    name, rename = "bert", lambda n: n
    if lora:
        adapter = os.path.join(os.path.dirname(out_path("bert", "bert")), "bert-lora-adapter")
        model, config["lora"] = with_lora(model, gen, ["query", "key", "value", "dense"], False, adapter)
        name, rename = "bert-lora", peft_name
    b, t = 2, 16
    ids = torch.randint(0, config["vocab_size"], (b, t), generator=gen)
    labels = torch.randint(0, config["vocab_size"], (b * t,), generator=gen)
    scored = (torch.rand(b * t, generator=gen) < 0.3).to(torch.float64)
    scored[0] = 1.0
    # Segments and padding from a generator of their own, so that the fixtures after this one keep
    # their draws: row 1 ends in 5 padding positions (not scored), token types are random.
    extra = torch.Generator().manual_seed(20261202)
    token_types = torch.randint(0, config["type_vocab_size"], (b, t), generator=extra)
    attention_mask = torch.ones(b, t, dtype=torch.int64)
    attention_mask[1, t - 5:] = 0
    scored = scored * attention_mask.reshape(-1)
    model = model.double().train()
    logits = model(input_ids=ids, token_type_ids=token_types, attention_mask=attention_mask).logits.reshape(b * t, -1)  # (B*T, V)
    logp = F.log_softmax(logits, dim=-1).gather(1, labels[:, None]).squeeze(1)
    loss = -(logp * scored).sum() / scored.sum()
    loss.backward()
    fixture = {"ids": ids, "token_types": token_types, "attention_mask": attention_mask, "labels": labels, "weights": scored,
               "logits": logits, "loss": loss,
               **grads(model, rename)}
    save(out_path("bert", name), weights, fixture, config)


def resnet(gen):
    from torchvision.models.resnet import Bottleneck

    # `resnet::Config`'s `tiny` preset: bottleneck blocks [1, 2, 2, 1], width 8, here 10 classes.
    # torchvision's ResNet class fixes the widths at 64..512, so the same layout is assembled here
    # from torchvision's own Bottleneck, with torchvision's attribute names and forward.
    layers, width, classes = [1, 2, 2, 1], 8, 10

    class TinyResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            c_in = width
            for i, n in enumerate(layers):
                planes = width << i
                blocks = []
                for j in range(n):
                    stride = 2 if i > 0 and j == 0 else 1
                    down = None
                    if stride != 1 or c_in != planes * 4:
                        down = nn.Sequential(nn.Conv2d(c_in, planes * 4, 1, stride, bias=False), nn.BatchNorm2d(planes * 4))
                    blocks.append(Bottleneck(c_in, planes, stride, down))
                    c_in = planes * 4
                setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(c_in, classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    model = TinyResNet()
    randomise(model, gen, lambda n, p: (2.0 / p[0].numel()) ** 0.5 if p.dim() == 4 else 0.1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}  # as torchvision saves it: counters included
    # 64x64: layer4 then normalises 4 samples x 2x2 positions; at 2 x 32x32 its BatchNorm would see
    # two values in all, and f32 rounding would dominate its statistics.
    b, size = 4, 64
    images = torch.randn(b, 3, size, size, generator=gen)
    labels = torch.randint(0, classes, (b,), generator=gen)
    model = model.double()
    with torch.no_grad():
        logits = model.eval()(images.double())
    loss = F.cross_entropy(model.train()(images.double()), labels)
    loss.backward()
    after = {f"after.{k}": v for k, v in model.state_dict().items() if k.endswith(("running_mean", "running_var"))}
    fixture = {"images": images, "labels": labels, "logits": logits, "loss": loss, **grads(model, lambda n: n), **after}
    config = dict(preset="tiny", layers=layers, width=width, classes=classes, image_size=size)
    save(out_path("resnet", "resnet"), weights, fixture, config)


def unet3d(gen, norm, loss_kind):
    """`unet3d::Config`'s `tiny` preset (base 4, 2 levels, 1 input channel, 3 classes), functional."""
    base, levels, classes, groups = 4, 2, 3, 2
    p = {}

    def conv_norm(prefix, i, c_in, c_out):
        p[f"{prefix}.conv{i}.weight"] = torch.randn(c_out, c_in, 3, 3, 3, generator=gen) * (2.0 / (c_in * 27)) ** 0.5
        p[f"{prefix}.norm{i}.weight"] = 1.0 + 0.2 * torch.randn(c_out, generator=gen)
        p[f"{prefix}.norm{i}.bias"] = 0.1 * torch.randn(c_out, generator=gen)
        if norm == "batch":
            p[f"{prefix}.norm{i}.running_mean"] = 0.1 * torch.randn(c_out, generator=gen)
            p[f"{prefix}.norm{i}.running_var"] = 0.5 + torch.rand(c_out, generator=gen)

    def level(name, c_in, c_mid, c_out, skip=None):
        if skip is not None:
            p[f"{name}.up.weight"] = torch.randn(c_in, c_in, 2, 2, 2, generator=gen) * (1.0 / (c_in * 8)) ** 0.5
            p[f"{name}.up.bias"] = 0.1 * torch.randn(c_in, generator=gen)
        conv_norm(name, 1, c_in + (skip or 0), c_mid)
        conv_norm(name, 2, c_mid, c_out)

    c, skips = 1, []
    for l in range(levels):
        level(f"enc.{l}", c, base << l, base << (l + 1))
        c = base << (l + 1)
        skips.append(c)
    level("bottom", c, c, 2 * c)
    c *= 2
    for l in reversed(range(levels)):
        level(f"dec.{l}", c, skips[l], skips[l], skip=skips[l])
        c = skips[l]
    p["head.weight"] = torch.randn(classes, c, 1, 1, 1, generator=gen) * (1.0 / c) ** 0.5
    p["head.bias"] = 0.1 * torch.randn(classes, generator=gen)
    weights = {k: v.clone() for k, v in p.items()}

    q = {k: v.double().requires_grad_(not k.endswith(("running_mean", "running_var"))) for k, v in p.items()}

    def forward(x, training):
        def block(prefix, x):
            for i in (1, 2):
                x = F.conv3d(x, q[f"{prefix}.conv{i}.weight"], padding=1)
                w, b = q[f"{prefix}.norm{i}.weight"], q[f"{prefix}.norm{i}.bias"]
                if norm == "batch":
                    x = F.batch_norm(x, q[f"{prefix}.norm{i}.running_mean"], q[f"{prefix}.norm{i}.running_var"], w, b,
                                     training=training, momentum=0.1, eps=1e-5)
                else:
                    x = F.group_norm(x, min(groups, x.shape[1]), w, b, eps=1e-5)
                x = F.relu(x)
            return x

        skips = []
        for l in range(levels):
            x = block(f"enc.{l}", x)
            skips.append(x)
            x = F.max_pool3d(x, 2)
        x = block("bottom", x)
        for l in reversed(range(levels)):
            up = F.conv_transpose3d(x, q[f"dec.{l}.up.weight"], q[f"dec.{l}.up.bias"], stride=2)
            x = block(f"dec.{l}", torch.cat([skips[l], up], 1))
        return F.conv3d(x, q["head.weight"], q["head.bias"])  # (N, K, D, H, W)

    n, side = 2, 8
    volume = torch.randn(n, 1, side, side, side, generator=gen)
    labels = torch.randint(0, classes, (n, side, side, side), generator=gen)
    with torch.no_grad():
        logits = forward(volume.double(), training=False)
    scores = forward(volume.double(), training=True)
    loss = F.cross_entropy(scores, labels)
    if loss_kind == "ce-dice":
        prob = F.softmax(scores, 1).permute(0, 2, 3, 4, 1).reshape(-1, classes)  # (N*D*H*W, K)
        onehot = F.one_hot(labels.reshape(-1), classes).double()
        dice = 2 * (prob * onehot).sum(0) / (prob.sum(0) + onehot.sum(0) + 1e-6)
        loss = loss + 1 - dice.mean()
    loss.backward()
    fixture = {"volume": volume, "labels": labels.reshape(-1), "logits": logits, "loss": loss,
               **{f"grad.{k}": v.grad for k, v in q.items() if v.requires_grad},
               **{f"after.{k}": v for k, v in q.items() if not v.requires_grad}}
    config = dict(preset="tiny", norm=norm, groups=groups, loss=loss_kind, side=side, batch=n)
    save(out_path("unet3d", f"unet3d-{norm}"), weights, fixture, config)


def adafactor(gen):
    """torch.optim.Adafactor over five steps of given gradients, in f64 from f32 starting values,
    for a matrix, a stack of matrices (factored over its last two axes), a vector and a scalar;
    eps1 pinned to f32's epsilon (PyTorch takes the parameter dtype's) and lr high enough that
    rho = 1/sqrt(t) takes over from step 3 on. Written to crates/optim/tests/fixtures/."""
    shapes = {"matrix": (6, 5), "stack": (2, 3, 4), "vector": (4,), "scalar": ()}
    config = {"lr": 0.6, "beta2_decay": -0.8, "eps1": float(torch.finfo(torch.float32).eps), "eps2": 1e-3, "d": 1.0,
              "weight_decay": 0.01, "steps": 5}
    params = {k: torch.randn(s, generator=gen).to(torch.float32).to(torch.float64).requires_grad_() for k, s in shapes.items()}
    fixture = {f"start.{k}": p.detach().clone() for k, p in params.items()}
    opt = torch.optim.Adafactor(params.values(), lr=config["lr"], beta2_decay=config["beta2_decay"],
                                eps=(config["eps1"], config["eps2"]), d=config["d"], weight_decay=config["weight_decay"],
                                foreach=False)
    for step in range(1, config["steps"] + 1):
        for k, p in params.items():
            # Gradients of varied scale per row, so the factored estimate differs from g^2.
            scale = torch.rand(shapes[k], generator=gen) * 2 + 0.1
            p.grad = (torch.randn(shapes[k], generator=gen) * scale).to(torch.float32).to(torch.float64)
            fixture[f"grad.{step}.{k}"] = p.grad.clone()
        opt.step()
        for k, p in params.items():
            fixture[f"after.{step}.{k}"] = p.detach().clone()
    save(out_path("optim", "adafactor"), {}, fixture, config)


def llama(gen, architecture, lora=False):
    """A tiny decoder of the Llama family (`architecture`: LlamaForCausalLM with Llama 3's rope
    scaling, MistralForCausalLM, Qwen2ForCausalLM with its q/k/v bias, Qwen3ForCausalLM with its
    q/k norms and a head_dim of its own), its `config.json` as `transformers` writes it in the
    metadata (the test reads it as `train-llama --config` does). `lora`: under PEFT's LoRA on
    every projection; the gradients are the adapters'."""
    import transformers

    cls = getattr(transformers, architecture)
    kwargs = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, attention_dropout=0.0, tie_word_embeddings=architecture != "LlamaForCausalLM",
                  attn_implementation="eager")
    if architecture == "LlamaForCausalLM":
        kwargs["rope_scaling"] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=16)
        kwargs["rope_theta"] = 10000.0
    if architecture == "Qwen3ForCausalLM":
        kwargs["head_dim"] = 16
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    model = cls(config_cls(**kwargs))
    # The rotary embedding's frequencies are buffers that no checkpoint holds: kept as computed.
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    randomise(model, gen, lambda n, p: 0.3 if p.dim() == 2 else 0.1)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])
    with torch.no_grad():  # RMSNorm weights around 1, as trained ones are
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(1.0)
    model.config.architectures = [architecture]  # as save_pretrained writes it
    config = model.config.to_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    short = architecture.removesuffix("ForCausalLM").lower()
    name, rename = short, lambda n: n
    if lora:
        adapter = os.path.join(os.path.dirname(out_path("llama", short)), f"{short}-lora-adapter")
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model, config["lora"] = with_lora(model, gen, targets, False, adapter)
        name = f"{short}-lora"
        rename = lambda n: n.removeprefix("base_model.model.").replace(".default.", ".")
    b, t = 2, 16
    ids = torch.randint(0, kwargs["vocab_size"], (b, t), generator=gen)
    targets_ = torch.randint(0, kwargs["vocab_size"], (b, t), generator=gen)
    model = model.double().train()
    logits = model(ids).logits  # (B, T, V)
    loss = F.cross_entropy(logits.reshape(b * t, -1), targets_.reshape(-1))
    loss.backward()
    fixture = {"ids": ids, "targets": targets_, "logits": logits, "loss": loss, **grads(model, rename)}
    save(out_path("llama", name), weights, fixture, config)


LLAMA_FAMILY = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["models", "adafactor", "lora", "llama"], help="write one group of fixtures (default: all)")
    only = parser.parse_args().only
    torch.use_deterministic_algorithms(True)
    if only in (None, "models"):
        gen = torch.Generator().manual_seed(20261130)
        gpt2(gen)
        bert(gen)
        resnet(gen)
        unet3d(gen, "batch", "ce-dice")
        unet3d(gen, "group", "ce")
    if only in (None, "adafactor"):
        adafactor(torch.Generator().manual_seed(20261201))
    if only in (None, "lora"):
        # Needs `peft` too. Each from a generator of its own, so the fixtures above keep their draws.
        gpt2(torch.Generator().manual_seed(20261203), lora=True)
        bert(torch.Generator().manual_seed(20261204), lora=True)
    if only in (None, "llama"):
        # The Llama family, full and under LoRA (needs `peft`).
        for i, architecture in enumerate(LLAMA_FAMILY):
            llama(torch.Generator().manual_seed(20261206 + i), architecture)
            llama(torch.Generator().manual_seed(20261216 + i), architecture, lora=True)


if __name__ == "__main__":
    main()
