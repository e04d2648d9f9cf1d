"""Fair dispatch: how claims are composed (``policy``, :class:`DispatchPolicy`),
token buckets in the database (``buckets``), and the claim composed class by
class (``claim``)."""

from .policy import DispatchPolicy

__all__ = ["DispatchPolicy"]
