"""Deprecated alias of the private :mod:`zerofn._checks`; removed in the next release.

What users touch is exported at the top level: ``zf.RankMismatchError`` and
``zf.check_ranks_agree``. Import those instead.
"""

from zerofn._checks import RankMismatchError, check_ranks_agree, validate_grads, validate_params

__all__ = ["RankMismatchError", "check_ranks_agree", "validate_grads", "validate_params"]
