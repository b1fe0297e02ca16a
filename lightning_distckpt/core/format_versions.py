"""The on-disk format's name and versions: the one place every writer and reader takes them from.

Each version bump is a change an older reader would misread, so older readers refuse the newer
version (docs/format.md, "Older versions"); every version listed here is still read.
"""

FORMAT_NAME = "lightning_distckpt"

#: The version this library writes (a checkpoint with aliases: ``ALIASES_SINCE``, see ``written_version``).
FORMAT_VERSION = 7
#: Every version the readers accept (a real checkpoint of each: tests/data/formats/).
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)

#: 2: small shards packed into one array per rank and dtype.
PACKS_SINCE = 2
#: 3: checksums on everything (chunks, objects, the metadata's hash in COMMITTED).
CHECKSUMS_SINCE = 3
#: 4: an even dim-0 split is one index entry (planning/even_index.py).
EVEN_SINCE = 4
#: 5: chunk checksums may be kept in each array's zarr.json instead of the crc32c codec
#: (storage/chunk_checksums.py): a reader that does not know them would read those chunks unverified.
ZARR_JSON_CHECKSUMS_SINCE = 5
#: 6: plain tensors of the state are stored as tensors, their places in the tree in ``plain_tensors``:
#: an older reader would restore the common state without them.
PLAIN_TENSORS_SINCE = 6
#: 7: every rank store bound to its save (storage/save_token.py): a token in metadata.json, in each
#: array's zarr.json and in each object's checksum; an older reader would refuse the arrays' attribute.
SAVE_TOKEN_SINCE = 7
#: 8: tied tensors stored once: ``aliases`` names each key served from another key's stored shards.
#: Written only by saves that found a tie, so a checkpoint without one stays readable by older releases;
#: an older reader would find the aliased keys missing.
ALIASES_SINCE = 8


def written_version(has_aliases: bool) -> int:
    """The version a save records: the oldest that reads it whole."""
    return ALIASES_SINCE if has_aliases else FORMAT_VERSION
