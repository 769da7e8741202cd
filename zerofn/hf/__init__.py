"""zerofn inside the Hugging Face Trainer: :class:`ZeroTrainer`, ZeRO-1/2 for ``transformers.Trainer``.

Needs the optional extra ``zerofn[hf]`` (``transformers==5.23.0``, ``accelerate==1.16.0``).
The one change in a Trainer script::

    from zerofn.hf import ZeroTrainer as Trainer  # was: from transformers import Trainer

launched with ``torchrun``: ZeRO-2 with :class:`~zerofn.ZeroOptimizer`'s defaults;
``ZeroTrainer(..., stage=1)`` for ZeRO-1, and every zerofn option as a keyword. What it
overrides in the Trainer, and why: :mod:`zerofn.hf._trainer`; what it refuses:
:mod:`zerofn.hf._checks`; the checkpoint layout: :mod:`zerofn.hf._checkpoint`. The guide:
the docs' "Hugging Face Trainer" page.
"""

try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised by a subprocess in tests/test_hf.py
    raise ImportError(
        "zerofn.hf needs transformers and accelerate, an optional extra of zerofn: pip install 'zerofn[hf]' "
        "(it pins transformers==5.23.0 and accelerate==1.16.0; install torch first so that pip keeps yours). "
        f"The import failed with: {e}"
    ) from e

from zerofn.hf._trainer import ZeroTrainer

__all__ = ["ZeroTrainer"]
