"""The PyTorch modes (eager, autocast bf16, torch.compile, PyTorch/XLA): a RoBERTa of transformers with SDPA
attention, the LM head at the masked positions (or, in the reference rows, everywhere), and the optimizer and schedule
as the Trainer (pytorch/run_mlm.py) builds them, fused AdamW where torch has it."""

import contextlib
import os

import torch
import torch.nn.functional as F

from benchmarks.measure import profiled, step_batch, timed_loop, worker_main
from benchmarks.modes import BETAS, EPS, LEARNING_RATE, MODES, WEIGHT_DECAY, warmup_steps_for


def device_of(mode):
    if mode.framework == "pytorch/xla":
        import torch_xla

        return torch_xla.device()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build(spec, mode, device, total_steps):
    """The model (SDPA attention where not on XLA), the Trainer's optimizer and schedule for `total_steps`."""
    from transformers import AutoModelForMaskedLM, Trainer, TrainingArguments

    attention = {} if device.type == "xla" else {"attn_implementation": "sdpa"}
    path = os.path.join(spec["init_dir"], "pytorch")
    model = AutoModelForMaskedLM.from_pretrained(path, **attention).to(device).train()
    args = TrainingArguments(
        output_dir=spec["work_dir"],
        learning_rate=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        warmup_steps=warmup_steps_for(total_steps),
        lr_scheduler_type="linear",
        optim="adamw_torch" if device.type == "xla" else "adamw_torch_fused",  # no fused kernel for XLA tensors
        report_to="none",
        use_cpu=device.type == "cpu",
    )
    trainer = Trainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=total_steps)
    return model, trainer.optimizer, trainer.lr_scheduler


def loss_of(model, input_ids, attention_mask, labels, positions=None):
    """Mean cross-entropy over the labelled tokens: with `positions` [rows, K], the head runs on the hidden states
    at those positions only (labels [rows, K]); without, at every position, as the model's forward does."""
    if positions is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    else:
        hidden = model.roberta(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = model.lm_head(torch.take_along_dim(hidden, positions[..., None], dim=1))
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def train(spec, batches):
    mode = MODES[spec["mode"]]
    device = device_of(mode)
    model, optimizer, scheduler = build(spec, mode, device, batches["input_ids"].shape[0])
    forward = torch.compile(loss_of) if mode.compiled else loss_of
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode.precision == "bf16")
    sync = __import__("torch_xla").sync if device.type == "xla" else lambda: None  # XLA runs the step's graph here

    def tensors(batch):
        names = ("input_ids", "attention_mask", "labels", "masked_positions")
        return [torch.from_numpy(batch[k]).long().to(device) if k in batch else None for k in names]

    def run(batch):
        with autocast:
            loss = forward(model, *tensors(batch))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return float(loss.item())

    times, losses = timed_loop(run, batches, mode.head)
    extra = {}
    if spec["profile_steps"] and device.type != "xla":
        extra["profile"] = profiled(run, batches, spec["profile_steps"], mode.head, torch_trace)
    if device.type != "xla":  # what one step executes, counted on the eager model (the same products compiled)
        extra.update(executed_flops=executed_flops(model, tensors(step_batch(batches, 0, mode.head)), autocast))
        extra["executed_by"] = "torch.utils.flop_counter on one eager step"
    return dict(
        times=times,
        losses=losses,
        num_params=int(sum(p.numel() for p in model.parameters())),
        versions=versions(device),
        threads=torch.get_num_threads(),
        products="bf16" if mode.precision == "bf16" else "tf32" if tf32(device) else "fp32",
        device_peak_mb=torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
        **extra,
    )


def executed_flops(model, tensors, autocast):
    """The FLOPs of one forward and backward pass's matrix products and attention, by torch's own counter."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        with autocast:
            loss = loss_of(model, *tensors)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def tf32(device):
    return device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32  # off by default: f32 products in f32


def versions(device):
    if device.type == "xla":
        import torch_xla

        return {"torch (.venv-xla)": torch.__version__, "torch_xla": torch_xla.__version__}
    return {"torch": torch.__version__, **({"CUDA (torch)": torch.version.cuda} if device.type == "cuda" else {})}


@contextlib.contextmanager
def torch_trace(kernels):
    """torch.profiler, its kernels added to `kernels` on exit: the CUDA kernels, or on a CPU the aten ops' self
    time. Yields the list of what was read."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    read = ["CUDA kernels" if cuda else "aten ops (self CPU time)"]
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        yield read
    for a in prof.key_averages():
        if (a.device_type == torch.autograd.DeviceType.CUDA) if cuda else a.key.startswith("aten::"):
            kernels[a.key] = [a.device_time_total if cuda else a.self_cpu_time_total, a.count]


def matmul_call(precision, a, b):
    """A call of one n x n product in fp32 or bf16, on the GPU where there is one."""
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, y = torch.from_numpy(a).to(device, dtype), torch.from_numpy(b).to(device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    return lambda: (torch.mm(x, y), sync())


if __name__ == "__main__":
    worker_main(train, matmul_call)
