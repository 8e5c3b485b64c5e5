"""Hugging Face Trainer on 2 CPU ranks (``torchrun --nproc_per_node 2``; run by
test_integrations.py). Writes ``rank{R}.json`` into argv[1].

A 2-layer GPT-2 built from its config (tied embeddings, no dropout) on synthetic token
sequences; per optimizer (SGD momentum 0.9, AdamW with a fixed variance freeze):

1. ``register(trainer, SPEC, algorithm="allgather")`` — the one added line — 12 steps,
   checkpoints at 6 and 12;
2. the same Trainer loop with ``comms.register`` done by hand on ``trainer.model_wrapped``
   (a callback holding the trainer): the parameter bits of 1;
3. a fresh Trainer resuming 1's ``checkpoint-6``: the parameter bits of 1;
4. (SGD) resuming a copy of ``checkpoint-6`` without the commpress files: a WARNING, the hook
   restarts from step 0 with the momentum it took over.
"""

import json
import os
import shutil
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import comms
from comms.integrations.pairing import unwrap_optimizer
from comms.integrations.transformers import STATE_FILE, register

SPEC, STEPS, SAVE = "topk:density=0.01", 12, 6
OPTIMIZERS = {"sgd": dict(optim="sgd", optim_args="momentum=0.9", learning_rate=0.1),
              "adamw": dict(optim="adamw_torch", learning_rate=3e-3)}
EXTRA = {"sgd": {}, "adamw": {"adam_freeze": 4}}


def make_model():
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def dataset():
    """128 arithmetic sequences mod 64: a start and a stride per sample."""
    g = torch.Generator().manual_seed(1)
    starts, strides = torch.randint(0, 64, (128,), generator=g), torch.randint(1, 8, (128,), generator=g)
    seqs = (starts[:, None] + strides[:, None] * torch.arange(16)) % 64
    return [{"input_ids": s, "labels": s} for s in seqs]


def arguments(out, opt):
    return TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=STEPS,
                             save_steps=SAVE, logging_steps=1, use_cpu=True, ddp_backend="gloo",
                             report_to="none", seed=0, disable_tqdm=True, **OPTIMIZERS[opt])


class ByHand(TrainerCallback):
    """What a user writes without the integration: register on the DDP model Trainer built."""

    def __init__(self, trainer, **options):
        self.trainer, self.options, self.state = trainer, options, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = comms.register(self.trainer.model_wrapped, SPEC,
                                    optimizer=unwrap_optimizer(self.trainer.optimizer), **self.options)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run(out, opt, resume=None, by_hand=False):
    model = make_model()
    trainer = Trainer(model=model, args=arguments(out, opt), train_dataset=dataset())
    options = dict(algorithm="allgather", **EXTRA[opt])
    if by_hand:
        cb = ByHand(trainer, **options)
        trainer.add_callback(cb)
    else:
        cb = register(trainer, SPEC, **options)
    trainer.train(resume_from_checkpoint=resume)
    st, inner = cb.state, unwrap_optimizer(trainer.optimizer)
    logged = [e for e in trainer.state.log_history if "commpress/wire_bytes" in e]
    return flat(model), {
        "iter": st.iter, "wire": st.wire_bytes_per_step(), "dense": st.dense_bytes_per_step(),
        "hook_momentum": st.momentum, "opt_momentum": inner.param_groups[0].get("momentum"),
        "frozen_at": None if st.adam is None else st.adam.freeze_iter,
        "logged_steps": len(logged),
        "logged_ratio": logged[-1]["commpress/ratio"] if logged else None,
    }


def main(out):
    rank = int(os.environ["RANK"])
    res = {"rank": rank}
    for opt in OPTIMIZERS:
        root = os.path.join(out, opt)
        a, res[opt] = run(os.path.join(root, "a"), opt)
        ckpt = os.path.join(root, "a", f"checkpoint-{SAVE}")
        res[opt]["files"] = sorted(f for f in os.listdir(ckpt) if f.startswith("commpress"))
        ref, res[opt + "_by_hand"] = run(os.path.join(root, "ref"), opt, by_hand=True)
        b, res[opt + "_resumed"] = run(os.path.join(root, "b"), opt, resume=ckpt)
        res[opt + "_equal_by_hand"] = torch.equal(a, ref)
        res[opt + "_equal_resumed"] = torch.equal(a, b)
        res[opt + "_a_differs_initial"] = not torch.equal(a, flat(make_model()))
    plain = os.path.join(out, "sgd", "plain")
    if rank == 0:  # a checkpoint as a run without commpress writes it
        shutil.copytree(os.path.join(out, "sgd", "a", f"checkpoint-{SAVE}"), plain)
        for r in range(int(os.environ["WORLD_SIZE"])):
            os.remove(os.path.join(plain, STATE_FILE.format(rank=r)))
    torch.distributed.barrier()
    _, res["plain"] = run(os.path.join(out, "sgd", "c"), "sgd", resume=plain)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
