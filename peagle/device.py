"""Where a run computes: one device and one dtype, decided once when it starts (nanoGPT style).

Invariant: every tensor of a run lives on the device and floating weights / caches / activations use the dtype
chosen here; nothing below this module asks torch which devices exist. "auto" picks CUDA with bfloat16 when a
GPU is visible (float16 on GPUs without bfloat16), else the CPU with float32. Asking for CUDA on a machine
without one is a one-line PeagleError, not a stack trace."""
from __future__ import annotations

import torch

from .errors import PeagleError

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(device="auto") -> torch.device:
    """"auto" | "cpu" | "cuda" | "cuda:N" | torch.device -> torch.device (CUDA checked to exist)."""
    if isinstance(device, torch.device):
        dev = device
    else:
        name = str(device or "auto").strip().lower()
        if name == "auto":
            return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise PeagleError(f"device must be one of {', '.join(DEVICE_CHOICES)} (or cuda:N), got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PeagleError("device cuda was asked for but no CUDA GPU is available (torch.cuda.is_available() is "
                          "False); use --device cpu or auto")
    if dev.type not in ("cpu", "cuda", "meta"):
        raise PeagleError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {device!r}")
    return dev


def resolve_dtype(dtype="auto", device: torch.device | str = "cpu") -> torch.dtype:
    """"auto" -> bfloat16 on CUDA (float16 where the GPU lacks bfloat16), float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype or "auto").strip().lower()
    if name == "auto":
        dev = torch.device(device)
        if dev.type == "cuda":      # native bfloat16 on that GPU (torch's default counts emulated bf16, V100 / T4)
            with torch.cuda.device(dev):
                return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        return torch.float32
    if name not in DTYPES:
        raise PeagleError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    return DTYPES[name]


def resolve(device="auto", dtype="auto") -> tuple[torch.device, torch.dtype]:
    dev = resolve_device(device)
    return dev, resolve_dtype(dtype, dev)


def cpuinfo(field: str) -> str | None:
    """The value of /proc/cpuinfo's first `field` line ("model name", "flags"): "" where no line has it, None
    where the file cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(field)), "")
    except OSError:
        return None


def cpu_amx_bf16() -> bool:
    """Does this CPU have AMX-BF16 tiles (amx_bf16 in /proc/cpuinfo's flags)? Training in bfloat16 pays only there:
    on a 2-core Intel Xeon, whole training steps in bfloat16 autocast took 1.82x / 3.04x less time than float32
    (EAGLE-3 / P-EAGLE) with oneDNN on the tiles, and 0.76x / 0.93x (slower) with oneDNN held to AVX-512-BF16
    (DNNL_MAX_CPU_ISA=AVX512_CORE_BF16, as on a CPU without AMX): docs/training-study/train-cost-no-amx.md.
    Without avx512_bf16 either, oneDNN emulates bfloat16: slower still."""
    return "amx_bf16" in (cpuinfo("flags") or "").split()


def train_compute_dtype(dtype, device: torch.device) -> torch.dtype:
    """Training's compute dtype for the drafter head (its autocast; weights stay float32). An explicit dtype as
    given; "auto": what resolve_dtype picks on CUDA, and on a CPU bfloat16 where it has AMX-BF16 (cpu_amx_bf16),
    else float32. Never float16: its gradients underflow without loss scaling, which the trainer does not do
    (asked for: refused; auto on a GPU without bfloat16: float32)."""
    if _auto_on_cpu(dtype, device):
        return torch.bfloat16 if cpu_amx_bf16() else torch.float32
    d = resolve_dtype(dtype, device)
    if d == torch.float16:
        if str(dtype or "auto").strip().lower() == "auto":
            return torch.float32
        raise PeagleError("training in float16 needs loss scaling, which peagle's trainer does not do: use "
                          "--dtype bfloat16 or float32")
    return d


def train_dtype_reason(dtype, device: torch.device) -> str:
    """Why train_compute_dtype chose the head's dtype, where it chose by the CPU ("auto" on a CPU), else ""."""
    if not _auto_on_cpu(dtype, device):
        return ""
    return "AMX-BF16 tiles" if cpu_amx_bf16() else "no AMX-BF16, where bfloat16 is slower"


def _auto_on_cpu(dtype, device) -> bool:
    return str(dtype or "auto").strip().lower() == "auto" and torch.device(device).type == "cpu"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


AUTO_DTYPE_HELP = "auto: bfloat16 on CUDA (float16 where the GPU lacks native bfloat16), float32 on CPU (default auto)"


def add_arguments(p, dtype_help: str = AUTO_DTYPE_HELP):
    """--device and --dtype, the same for every command that runs a model (dtype_help: what auto means there)."""
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                   help="auto: CUDA when available, else CPU (default auto)")
    p.add_argument("--dtype", default="auto", type=str.lower, choices=DTYPE_CHOICES + ("fp32", "bf16", "fp16"),
                   help=dtype_help)


def synchronize(device: torch.device):
    """Wait for the device's queued work (timing only; the engine's step never calls this)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
