"""A Transformers model and the Trainer, in the book's vocabulary: what the ``trainer_deepspeed``
run trains (chapter 7).

The model is a GPT-2 built from the run config's model keys — nothing is downloaded — with
dropout off, so that a forward pass is a pure function of the weights. The data are the
synthetic batches of every other run (:func:`handbook_lib.runtime.data.make_batch`): item ``i`` is
sequence ``i % batch_size`` of step ``i // batch_size``. :class:`RecordingTrainer` keeps the
exact loss of every training step (the Trainer logs them rounded to 4 decimals).
"""

from __future__ import annotations

import warnings

import torch

# In a notebook without ipywidgets, tqdm.auto (imported by Transformers) warns that its widget
# bars fall back to text: true, harmless, and not the reader's to act on.
warnings.filterwarnings("ignore", message="IProgress not found")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402 - after the filter

from handbook_lib.core.config import RunConfig  # noqa: E402
from handbook_lib.runtime.data import make_batch  # noqa: E402

__all__ = ["probe_logits_on_cpu", "gpt2_config", "build_gpt2", "SyntheticLM", "RecordingTrainer", "probe_batch",
           "probe_logits", "training_arguments", "deepspeed_state_over_gloo", "zero3_partition_elements"]


def gpt2_config(config: RunConfig) -> GPT2Config:
    """GPT-2 with the run's sizes: ``d_model`` wide, ``nhead`` heads, ``dim_feedforward`` in the
    MLP, ``num_layers`` blocks, ``seq_len`` positions, ``vocab_size`` tokens; no dropout."""
    return GPT2Config(vocab_size=config.vocab_size, n_positions=config.seq_len, n_embd=config.d_model,
                      n_head=config.nhead, n_inner=config.dim_feedforward, n_layer=config.num_layers,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def build_gpt2(config: RunConfig) -> GPT2LMHeadModel:
    """The seeded GPT-2 of :func:`gpt2_config` (the same weights for the same ``seed``)."""
    torch.manual_seed(config.seed)
    return GPT2LMHeadModel(gpt2_config(config))


class SyntheticLM(torch.utils.data.Dataset):
    """``steps × batch_size`` sequences of the synthetic task, as the Trainer wants them
    (``input_ids`` and ``labels``, the model shifting the labels itself)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config

    def __len__(self) -> int:
        return self.config.steps * self.config.batch_size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        inputs, _ = make_batch(self.config, index // self.config.batch_size)
        row = inputs[index % self.config.batch_size]
        return {"input_ids": row, "labels": row}


class RecordingTrainer(Trainer):
    """The Trainer, keeping each training step's loss as a float in :attr:`losses`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.losses.append(float(loss))
        return loss

    def step_losses(self) -> list[float]:
        """One value per optimizer step: the recorded losses of its micro-steps
        (``gradient_accumulation_steps`` of them), summed."""
        k = self.args.gradient_accumulation_steps
        return [sum(self.losses[i:i + k]) for i in range(0, len(self.losses), k)]


def deepspeed_state_over_gloo() -> dict:
    """Make Accelerate's process state a DeepSpeed state of the whole torchrun world over gloo,
    for a Trainer on ranks without a GPU; returns the ``TrainingArguments`` keywords that make
    the Trainer use it (``accelerator_config={"use_configured_state": True}``).

    Left to itself, the Trainer asks Accelerate for a DeepSpeed state, and Accelerate chooses a
    distributed backend only for an accelerator device. On CPU ranks it finds none and counts
    one process, while DeepSpeed counts them all, and DeepSpeed's batch check stops the job.
    Naming the backend (``PartialState(backend="gloo")``, with ``ACCELERATE_USE_DEEPSPEED`` set
    as the Trainer sets it) gives the whole world. Call it before each Trainer: an
    ``Accelerator``'s DeepSpeed plugin is set once per state, so the old state is dropped first
    with ``AcceleratorState._reset_state``, Accelerate's private reset that ``TrainingArguments``
    itself calls.
    """
    import os

    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"accelerator_config": {"use_configured_state": True}}


def zero3_partition_elements(model: torch.nn.Module) -> int:
    """Elements of the parameters this rank holds under ZeRO-3: each parameter's partition
    (``ds_tensor``), or the whole tensor where DeepSpeed keeps it (no partition)."""
    return sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())


def probe_batch(config: RunConfig) -> torch.Tensor:
    """Two sequences of step 0's batch: the inputs whose logits compare two copies of a model."""
    return make_batch(config, 0)[0][:2]


@torch.no_grad()
def probe_logits(model: torch.nn.Module, config: RunConfig) -> torch.Tensor:
    """``model``'s fp32 logits on :func:`probe_batch`, in eval mode, on the CPU."""
    model.eval()
    device = next(model.parameters()).device
    return model(input_ids=probe_batch(config).to(device)).logits.float().cpu()


def probe_logits_on_cpu(model: torch.nn.Module, config: RunConfig) -> torch.Tensor:
    """:func:`probe_logits` of a CPU copy of ``model`` (a fresh GPT-2 given its state dict): the
    same kernels as :func:`saved_logits_difference`'s plain process, so a trained model on a
    GPU is compared with its saved copy on the CPU exactly (cuBLAS and MKL differ by ~1e-6)."""
    copy = GPT2LMHeadModel(gpt2_config(config))
    copy.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return probe_logits(copy, config)


def saved_logits_difference(model_dir: str, logits_file: str, config: RunConfig) -> float:
    """The largest absolute difference between the logits saved in ``logits_file`` and those of
    ``GPT2LMHeadModel.from_pretrained(model_dir)`` on :func:`probe_batch`, in this process (call
    it from a plain process: where DeepSpeed's ZeRO-3 is configured, ``from_pretrained`` builds
    the model partitioned)."""
    loaded = GPT2LMHeadModel.from_pretrained(model_dir)
    return float((probe_logits(loaded, config) - torch.load(logits_file)).abs().max())


if __name__ == "__main__":  # python -m handbook_lib.integrations.hf_trainer MODEL_DIR LOGITS_FILE CONFIG_JSON
    import json
    import sys

    model_dir, logits_file, config_json = sys.argv[1:4]
    config = RunConfig.from_mapping({k: v for k, v in json.loads(config_json).items() if k in RunConfig.keys()})
    print(json.dumps({"max_abs_diff": saved_logits_difference(model_dir, logits_file, config)}))


def training_arguments(keywords: dict, output_dir: str) -> TrainingArguments:
    """``TrainingArguments(**keywords)``, Transformers' own check of them, on this machine.

    Without a GPU, ``use_cpu=True`` (Transformers refuses ``bf16`` on a machine with no bf16
    GPU otherwise; no key compared by the book changes). The ``FSDP_*`` and ``ACCELERATE_*``
    variables the arguments write into the environment are undone, so that later runs started
    from this process do not inherit them.
    """
    import os

    saved = {k: v for k, v in os.environ.items() if k.startswith(("FSDP_", "ACCELERATE_"))}
    try:
        return TrainingArguments(output_dir=output_dir, report_to="none",
                                 use_cpu=not torch.cuda.is_available(), **keywords)
    finally:
        for key in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
            del os.environ[key]
        os.environ.update(saved)
