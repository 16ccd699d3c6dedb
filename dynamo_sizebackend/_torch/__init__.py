"""Every private torch API the package touches, one module per torch subsystem
(written against torch 2.13):

- :mod:`.dynamo`: placeholder metadata, Dynamo's exceptions and compile lock, float
  restarts, compile sessions, an unbacked batch mark;
- :mod:`.shape_env`: fake modes, symbols, value ranges, hints and guards;
- :mod:`.inductor`: ``standalone_compile``, Inductor's config, artifact save/load;
- :mod:`.direct_call`: the fast path into Inductor's generated code (with an off switch);
- :mod:`.fx`: ``split_module`` and op-overload schemas;
- :mod:`.process`: Python's own private exit-hook registration;
- :mod:`.autotune`, :mod:`.templates`: Inductor's autotune candidates and Jinja kernel
  templates, changed for the backend's own compiles only (:mod:`.hooks`).

Nothing outside this package imports ``torch._*`` or reads ``SymInt.node``.
"""
import torch

TORCH_VERSION = torch.__version__


def tensor_version(tensor: torch.Tensor) -> int:
    """The tensor's version counter: bumped by every in-place write (``Tensor._version``)."""
    return tensor._version
