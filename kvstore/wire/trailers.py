"""What follows a PUT's payloads on the data socket, both ends' one definition.

A writer that hashes while it sends (``PutRequest.sums_follow``) puts each payload's
xxh3 right after that payload: :data:`SUM_TRAILER`. A layer-by-layer PUT
(``PutRequest.layers``) ends its body with one :data:`KEEP_TRAILER` per item: the
item's xxh3 over all its layers and whether to keep it (False: withdrawn, its
reservation is aborted rather than committed).
"""

from __future__ import annotations

import struct

__all__ = ["KEEP_TRAILER", "SUM_TRAILER"]

SUM_TRAILER = struct.Struct("<Q")  # a payload's xxh3, after it
KEEP_TRAILER = struct.Struct("<QB")  # a layer-by-layer item's xxh3 and keep flag
