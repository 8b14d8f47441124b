"""The plaintext inside an encrypted share message (Bonawitz et al., 2017, §4, round 1:
``u || v || s_sk share || b share``). Sender and recipient are repeated inside the
ciphertext so a recipient can check who really wrote it.
"""

from __future__ import annotations

import struct

from orchard.secure_agg.crypto import KEY_BYTES
from orchard.secure_agg.errors import MalformedMessage
from orchard.secure_agg.prg import SEED_BYTES
from orchard.secure_agg.shamir import share_size

MASK_KEY_SHARE_BYTES = share_size(KEY_BYTES)
SELF_MASK_SHARE_BYTES = share_size(SEED_BYTES)
GCM_TAG_BYTES = 16


def pack_shares(sender: str, recipient: str, key_share: bytes, seed_share: bytes) -> bytes:
    s, r = sender.encode(), recipient.encode()
    return struct.pack(">H", len(s)) + s + struct.pack(">H", len(r)) + r + key_share + seed_share


def ciphertext_size(sender: str, recipient: str) -> int:
    return (4 + len(sender.encode()) + len(recipient.encode()) + MASK_KEY_SHARE_BYTES
            + SELF_MASK_SHARE_BYTES + GCM_TAG_BYTES)


def unpack_shares(plaintext: bytes) -> tuple[str, str, bytes, bytes]:
    try:
        pos = 0
        (ls,) = struct.unpack_from(">H", plaintext, pos)
        pos += 2
        sender = plaintext[pos:pos + ls].decode()
        pos += ls
        (lr,) = struct.unpack_from(">H", plaintext, pos)
        pos += 2
        recipient = plaintext[pos:pos + lr].decode()
        pos += lr
    except (struct.error, UnicodeDecodeError):
        raise MalformedMessage("decrypted shares do not parse") from None
    rest = plaintext[pos:]
    if len(rest) != MASK_KEY_SHARE_BYTES + SELF_MASK_SHARE_BYTES:
        raise MalformedMessage(f"decrypted shares hold {len(rest)} bytes, expected "
                               f"{MASK_KEY_SHARE_BYTES + SELF_MASK_SHARE_BYTES}")
    return sender, recipient, rest[:MASK_KEY_SHARE_BYTES], rest[MASK_KEY_SHARE_BYTES:]
