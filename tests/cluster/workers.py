"""Functions the cluster tests run on every rank (JSON in, JSON out)."""

import hashlib
import os

import torch
import torch.distributed as dist


def whoami(rank, world_size):
    import socket

    t = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(t)
    local = os.environ["DISTCKPT_TIER_DIR"]
    with open(os.path.join(local, f"rank-{rank}"), "w") as f:
        f.write("x")
    return {"node": int(os.environ["GROUP_RANK"]), "sum": int(t.item()), "local": sorted(os.listdir(local)),
            "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "host": socket.gethostname()}


def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _model(world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(rank, world_size, run, steps, resume=False, hold=False, persist_every=0, replicas=1, corrupt=None,
          preempt_grace_s=None, extra_mb=0, keep_local=2, fail_last=False):
    """Train to ``steps``, saving every step through a TieredCheckpointManager (resuming first with ``resume``);
    the loss of each step run, the restore report, and a digest of the final weights. With ``hold`` the rank
    waits, after its last save is done everywhere, to be killed (or preempted). With ``fail_last`` the last step's
    local copy fails on rank 1."""
    import logging
    import time

    import distckpt
    from distckpt.testing.cluster import mark

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    model, optim = _model(world_size)
    local = os.path.join(os.environ["DISTCKPT_TIER_DIR"], run)
    mgr = distckpt.TieredCheckpointManager(os.path.join(os.environ["DISTCKPT_TEST_DURABLE"], run), local=local,
                                           replicas=replicas, persist_every=persist_every, keep_local=keep_local)
    progress = {"step": 0}
    state = {"model": model, "optim": optim, "progress": progress}
    if extra_mb:  # bytes that make each phase of a save take a while (for kills that land inside one)
        state["extra"] = torch.zeros(extra_mb << 18)
    report = None
    if corrupt and rank == corrupt["holder"]:
        held = os.path.join(mgr.held_dir, f"rank-{corrupt['owner']}", f"step-{corrupt['step']}")
        # flip one bit in the middle of the first tensor's bytes (the record is read before the agreement)
        info = min((i for i in distckpt.read_metadata(held).storage_data.items.values() if i.length > 8),
                   key=lambda i: (i.file, i.offset))
        with open(os.path.join(held, info.file), "r+b") as f:
            f.seek(info.offset + info.length // 2)
            b = f.read(1)
            f.seek(info.offset + info.length // 2)
            f.write(bytes([b[0] ^ 1]))
    if resume:
        distckpt.init_optimizer_state(optim)
        r = mgr.restore(state)
        report = {"step": r.step, "tier": r.tier, "sources": {str(k): v for k, v in r.sources.items()},
                  "bytes_from": r.bytes_from, "progress": progress["step"], "rounds": r.rounds,
                  "weights": _weights(model), "extra": float(state["extra"][-1]) if extra_mb else None}
    if preempt_grace_s is not None:
        mgr.install_preemption_handler(grace_s=preempt_grace_s)
    losses, digests = {}, {}
    for step in range(progress["step"] + 1, steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = (model(x) - y).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses[str(step)] = loss.item()
        progress["step"] = step
        if extra_mb:
            state["extra"].fill_(step)
        digests[str(step)] = _weights(model)
        if fail_last and step == steps:  # node 1's tmpfs is full: its local copy of the last step fails
            from distckpt import faults

            mgr.wait()  # the fault is process-wide: earlier steps' background replication must not meet it
            with faults.inject(faults.Fault("enospc", kinds=("write",)) if rank == 1 else faults.Fault("call")):
                mgr.save(step, state)
                try:
                    mgr.wait()
                except distckpt.CheckpointError as exc:
                    print(f"rank {rank}: step {step} failed as planned: {str(exc)[:200]}", flush=True)
            continue
        mgr.save(step, state)
    mgr.wait()
    if hold:
        mark("saved")
        while True:
            time.sleep(0.5)
    mgr.close()
    return {"losses": losses, "report": report, "weights": _weights(model), "digests": digests}


def _weights(model):
    return {k: digest(v.full_tensor()) for k, v in model.state_dict().items()}


def save_state(rank, world_size, path):
    """Train one step and save model and optimizer (FSDP2 over every rank); digests of the full tensors."""
    import distckpt

    model, optim = _model(world_size)
    g = torch.Generator().manual_seed(7 + rank)
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    optim.step()
    distckpt.save({"model": model, "optim": optim}, checkpoint_id=path)
    return _full_digests(model, optim)


def load_state(rank, world_size, path, mesh_2d=False):
    """Load into a fresh model, sharded over a 2-D mesh (rows and columns) when ``mesh_2d``; digests."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import distckpt

    model, optim = _model(world_size)
    if mesh_2d:  # reshard every parameter over rows and columns instead of FSDP's rows
        mesh = init_device_mesh("cpu", (2, world_size // 2))
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        for m in (model[0], model[2]):
            m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0), Shard(1)]))
            m.bias = torch.nn.Parameter(distribute_tensor(m.bias.detach(), mesh, [Shard(0), Shard(0)]))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    distckpt.init_optimizer_state(optim)
    distckpt.load({"model": model, "optim": optim}, checkpoint_id=path)
    return _full_digests(model, optim)


def _full_digests(model, optim):
    out = {f"model.{k}": digest(v.full_tensor()) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optim.state.items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                out[f"optim.{names[id(p)]}.{k}"] = digest(v.full_tensor())
    return out


def sleep_forever(rank, world_size):
    """A job that runs until it is killed (tests/cluster/test_cleanup.py)."""
    import time

    time.sleep(600)
