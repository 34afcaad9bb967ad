"""Saved prompts found by their longest shared prefix: chained hashes of fixed chunks of token ids.

A prompt's ids are cut into chunks of CHUNK_TOKENS; chunk i's hash covers the seed (what decides a cache's contents
besides its prompt: model, tokenizer, template, stored tier and bits) and every id up to the end of chunk i:

    ids    [ chunk 0 ][ chunk 1 ][ chunk 2 ] ... [ tail shorter than a chunk: not indexed ]
    chain  h0 = H(seed, chunk 0)   h1 = H(h0, chunk 1)   h2 = H(h1, chunk 2) ...

Saving a cache writes one small entry per chunk, named by its hash and holding the cache's key
(CacheStore.index_prefixes). Two prompts share chunk i's hash exactly when they share their first i + 1 chunks, so
"some saved prompt shares the first i + 1 chunks" holds for every i up to the longest shared prefix and for none
after: a binary search finds it in about log2(chunks) + 1 look-ups (CacheStore.longest_prefix), whatever the
number of caches in the store. The exact shared length is then read from the cache's own ids.
"""

import hashlib

CHUNK_TOKENS = 256   # what a prefix is found to the nearest of (LMCache's chunk); less than one is not reused
HASH_CHARS = 32


def chunk_chain(seed: str, ids: "torch.Tensor") -> list[str]:
    """The chained hashes of the full chunks of `ids` (n,): [h0, h1, ...], n // CHUNK_TOKENS of them."""
    data = ids.cpu().numpy().astype("int64").tobytes()
    step = CHUNK_TOKENS * 8
    chain, previous = [], seed.encode()
    for start in range(0, len(data) - step + 1, step):
        previous = hashlib.sha256(previous + data[start:start + step]).hexdigest()[:HASH_CHARS].encode()
        chain.append(previous.decode())
    return chain


def longest_present(chain: list[str], present) -> int:
    """How many leading chunks of `chain` some saved prompt shares: the largest i with present(chain[i - 1]), found
    by binary search (present holds for a run of leading hashes and none after; see the module's docstring)."""
    low, high = 0, len(chain)  # present(chain[low - 1]) holds (or low is 0); present(chain[high]) does not
    if high == 0 or not present(chain[0]):
        return 0
    low = 1
    while low < high:
        middle = (low + high + 1) // 2
        if present(chain[middle - 1]):
            low = middle
        else:
            high = middle - 1
    return low


def shared_length(first: "torch.Tensor", second: "torch.Tensor") -> int:
    """How many leading ids two (n,) id tensors share."""
    length = min(first.shape[0], second.shape[0])
    differ = (first[:length].cpu() != second[:length].cpu()).nonzero()
    return int(differ[0, 0]) if differ.numel() else length
