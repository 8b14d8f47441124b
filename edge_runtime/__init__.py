"""On-device runtime: device state, budget policy and governor, LoRA training (torch, or
an ExecuTorch training program), ONNX inference, client bundles."""

import logging as _logging

# torchao (installed with executorch) is imported by peft, and on the CPU torch build it
# warns on every import that its CUDA-only kernels (mxfp8, sm90a cutlass) do not load.
# Nothing in Orchard uses them; its errors still show.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
# torchao also registers its Enum types with torch's pytree, which newer torch logs as a
# deprecation warning on every import (two lines a command). Only that logger is quieted.
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)
