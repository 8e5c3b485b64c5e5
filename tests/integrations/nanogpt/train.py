"""A training script shaped like nanoGPT's ``train.py`` (DDP under torchrun, gradient
accumulation by toggling ``model.require_backward_grad_sync``, AdamW with two param groups,
tied weights, grad clipping, a GradScaler, the learning-rate schedule, rank 0 writing
``ckpt.pt`` after each eval, ``init_from='resume'``) with no commpress line in it: the tests
add README's nanoGPT lines and run it.

Differences from the published script, all outside the lines README adds: CPU and gloo (no
``cuda.set_device``, no ``device_ids``), synthetic tokens instead of ``data/*.bin``, batches
drawn from a generator seeded by (rank, micro-batch index) instead of the global RNG, so a
resumed run sees the uninterrupted run's batches, and a barrier before leaving (README,
Troubleshooting). ``--key=value`` overrides a setting;
``--report=PATH`` writes each rank's final parameters and commpress hook numbers
(``PATH.rank{R}.pt``, ``PATH.rank{R}.json``).
"""

import json
import math
import os
import sys
import zlib
from contextlib import nullcontext

import numpy as np
import torch
from torch.distributed import barrier, destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import GPT, GPTConfig  # noqa: E402

# -----------------------------------------------------------------------------
out_dir = 'out'
eval_interval = 6
eval_iters = 2
always_save_checkpoint = True
init_from = 'scratch'
gradient_accumulation_steps = 4  # summed over ranks, as in nanoGPT
batch_size = 4
block_size = 32
n_layer, n_head, n_embd, dropout, bias = 2, 2, 32, 0.0, False
learning_rate = 3e-3
max_iters = 11  # evals (and checkpoints) at 0 and 6
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2
lr_decay_iters = 11
min_lr = 3e-4
backend = 'gloo'
device = 'cpu'
dtype = 'float32'
compile = False
report = ''
for arg in sys.argv[1:]:  # nanoGPT's configurator, in short
    key, val = arg[2:].split('=', 1)
    old = globals()[key]
    globals()[key] = val if isinstance(old, str) else type(old)(eval(val))
# -----------------------------------------------------------------------------

ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    init_process_group(backend=backend)
    ddp_rank = int(os.environ['RANK'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    ddp_world_size = int(os.environ['WORLD_SIZE'])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(1337)
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

# a learnable token stream: runs of a stride through the vocabulary
tokens = np.cumsum(np.random.default_rng(0).integers(1, 4, 20000)) % 64
data = {'train': tokens[:18000], 'val': tokens[18000:]}


def get_batch(split, index):
    g = torch.Generator().manual_seed(zlib.crc32(repr((seed_offset, split, index)).encode()))
    ix = torch.randint(len(data[split]) - block_size, (batch_size,), generator=g)
    x = torch.stack([torch.from_numpy(data[split][i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[split][i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(device), y.to(device)


model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias,
                  vocab_size=64, dropout=dropout)
if init_from == 'scratch':
    model = GPT(GPTConfig(**model_args))
    iter_num, best_val_loss = 0, 1e9
elif init_from == 'resume':
    checkpoint = torch.load(os.path.join(out_dir, 'ckpt.pt'), map_location=device)
    model = GPT(GPTConfig(**checkpoint['model_args']))
    model.load_state_dict(checkpoint['model'])
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == 'resume':
    optimizer.load_state_dict(checkpoint['optimizer'])
checkpoint = None
if compile:
    model = torch.compile(model)
if ddp:
    model = DDP(model)  # CPU: no device_ids
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split, ('eval', iter_num, k))
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


X, Y = get_batch('train', iter_num * gradient_accumulation_steps)
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses['val']
            if iter_num > 0:
                checkpoint = {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(),
                              'model_args': model_args, 'iter_num': iter_num, 'best_val_loss': best_val_loss}
                torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch('train', iter_num * gradient_accumulation_steps + micro_step + 1)
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num > max_iters:
        break

if report:  # the tests' instruments, one pair of files per rank
    st = getattr(model, '_commpress_state', None)
    report = f'{report}.rank{seed_offset}'
    torch.save(raw_model.state_dict(), report + '.pt')
    with open(report + '.json', 'w') as f:
        json.dump({'iter_num': iter_num, 'hook_iter': None if st is None else st.iter,
                   'wire': None if st is None else st.wire_bytes_per_step(),
                   'dense': None if st is None else st.dense_bytes_per_step(),
                   'frozen_at': None if st is None or st.adam is None else st.adam.freeze_iter,
                   'final_loss': loss.item() * gradient_accumulation_steps}, f)
if ddp:
    barrier()  # README, Troubleshooting: gloo can abort at exit when one rank leaves first
    destroy_process_group()
