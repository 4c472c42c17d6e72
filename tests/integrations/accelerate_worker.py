"""One rank of ``Accelerator.save_state``/``load_state`` under ``route_dcp_calls()``, run by torchrun from
test_accelerate.py: ``python accelerate_worker.py OUT_DIR RESULT_JSON [--cpu]``. An FSDP2 plugin is given; the result
(written by rank 0) says which distributed type accelerate chose, how many DCP calls were routed, what save_state
wrote, and whether load_state brought back the saved model and optimizer bit-exact."""

import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import get_state_dict

from distckpt.integrations.dcp_routing import route_dcp_calls


def _flat(model, optimizer):
    msd, osd = get_state_dict(model, optimizer)
    full = {f"model.{k}": v for k, v in msd.items()}
    full.update({f"optim.{key}.{name}": v for key, state in osd["state"].items() for name, v in state.items()})
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in full.items()}


def main(out_dir, result_path, cpu):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=cpu, fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def train(seed):
        g = torch.Generator().manual_seed(100 * seed + accelerator.process_index)
        accelerator.backward(model(torch.randn(5, 6, generator=g).to(accelerator.device)).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    with route_dcp_calls() as routing:
        for seed in (1, 2):  # the second save goes into the folders of the first
            train(seed)
            accelerator.save_state(out_dir)
        want = _flat(model, optimizer.optimizer)
        train(9)  # move away from the saved state
        accelerator.load_state(out_dir)
    got = _flat(model, optimizer.optimizer)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        names = sorted(os.listdir(out_dir))
        with open(result_path, "w") as f:
            json.dump({"distributed_type": accelerator.distributed_type.value, "routed": routing.calls, "files": names,
                       "committed": [n for n in names if os.path.isfile(os.path.join(out_dir, n, "metadata.json"))],
                       "same": want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--cpu" in sys.argv[3:])
