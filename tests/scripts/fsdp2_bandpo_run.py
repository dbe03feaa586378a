"""Run by tests/test_multi_node.py under `accelerate launch` (2 CPU processes, FSDP2, gloo): two BandPO steps with a
trainer checkpoint after the second (`<output_dir>/checkpoint-2`), then `save_model` to `<output_dir>/final`. Each
rank writes what it saw to `<output_dir>/fsdp2_rank<k>.json`: the logged metrics, the world size, whether FSDP2
sharded the model (its parameters are DTensors), the global step, and which parameters of the sharded model differed
from the checkpoint on disk when training began (none: the weight broadcast of cpu_ram_efficient_loading worked).

accelerate (1.16) applies FSDP only to a world of accelerators: `AcceleratorState` switches to
`DistributedType.FSDP` from MULTI_GPU, MULTI_NPU, MULTI_XPU, ... but not from MULTI_CPU, so on CPU the FSDP config
silently trains with plain DDP over gloo (and without `cpu=True`, which the training arguments' `use_cpu` passes, a
machine without GPUs does not even join the two processes: each is a world of 1).
`allow_fsdp_on_cpu` sets up accelerate's state for the gloo world torchrun started and presents it as a multi-device
world, so that the trainer's `Accelerator` takes the FSDP2 plugin from the launcher's environment; the trainer then
reuses that state (`use_configured_state`). Everything after that, fully_shard, the sharded optimizer step, the
weight broadcast of cpu_ram_efficient_loading and the FULL_STATE_DICT gathers of the checkpoint and of `save_model`,
is FSDP2 as on GPUs.
"""

import json
import os
import sys

from transformers import TrainerCallback
from zero3_bandpo_run import train  # the same run (this folder is on sys.path when run as a script)


def allow_fsdp_on_cpu() -> str:
    """The distributed type accelerate picks for this CPU world (MULTI_CPU in accelerate 1.16), after letting it
    apply FSDP there (see the module docstring); no change when it already would."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)  # joins the gloo world of torchrun's environment variables
    chosen = str(state.distributed_type)
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # AcceleratorState's FSDP gate
    return chosen


class StartingWeights(TrainerCallback):
    """When training begins (the model is sharded by then), the names of the parameters whose full value, gathered
    from the shards of every process, is not the checkpoint's."""

    def __init__(self, model_dir):
        self.model_dir, self.differing, self.compared = model_dir, None, 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import torch
        from safetensors.torch import load_file
        from torch.distributed.tensor import DTensor

        on_disk = load_file(os.path.join(self.model_dir, "model.safetensors"))
        self.differing = []
        for name, param in model.named_parameters():  # every process, in the same order: full_tensor() gathers
            value = param.detach().full_tensor() if isinstance(param, DTensor) else param.detach()
            if name not in on_disk or not torch.equal(value, on_disk[name].to(value.dtype)):
                self.differing.append(name)
            self.compared += 1


def main(model_dir, output_dir):
    from torch.distributed.tensor import DTensor

    accelerate_chose = allow_fsdp_on_cpu()
    starting = StartingWeights(model_dir)
    trainer = train(
        model_dir, output_dir, callbacks=[starting], save_strategy="steps", save_steps=2,
        accelerator_config={"use_configured_state": True},  # the state set up above
    )  # fmt: skip
    trainer.save_model(os.path.join(output_dir, "final"))  # FULL_STATE_DICT: gathered, written by the main process
    accelerator = trainer.accelerator
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    with open(os.path.join(output_dir, f"fsdp2_rank{accelerator.process_index}.json"), "w") as f:
        json.dump(
            {
                "log_history": trainer.state.log_history,
                "global_step": trainer.state.global_step,
                "world": accelerator.num_processes,
                "accelerate_chose": accelerate_chose,
                "distributed_type": str(accelerator.distributed_type),
                "backend": str(accelerator.state.backend),
                "fsdp_version": getattr(plugin, "fsdp_version", None),
                "deepspeed": trainer.is_deepspeed_enabled,
                "sharded": all(isinstance(p, DTensor) for p in trainer.model_wrapped.parameters()),
                "differing_at_start": starting.differing,
                "compared_at_start": starting.compared,
            },
            f,
        )
    accelerator.wait_for_everyone()  # the main process has written the model before any rank leaves
    trainer.end()
    os._exit(0)  # as in zero3_bandpo_run.py: skip the interpreter's teardown once everything is written


if __name__ == "__main__":
    main(*sys.argv[1:3])
