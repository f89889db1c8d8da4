"""Block names forced to collide, for tests that a prefix cache confirms a hit on the blocks'
contents: both places that name blocks (a prompt's, Request.prompt_block_names, and the paged
KV manager's after them) name them with `chain(parent, identity)` instead of the chained hash."""

from inferlab.core.blocks import block_identity


def collide_block_names(monkeypatch, chain) -> None:
    def names(token_ids, block_size, num_blocks, hashes=None, identities=None):
        hashes = [] if hashes is None else hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            identity = block_identity(token_ids, i * block_size, (i + 1) * block_size)
            hashes.append(chain(hashes[-1] if i else 0, identity))
            if identities is not None:
                identities.append(identity)
        return hashes

    import inferlab.core.request
    import inferlab.plugins.kv_cache.paged

    monkeypatch.setattr(inferlab.core.request, "block_hashes", names)
    monkeypatch.setattr(inferlab.plugins.kv_cache.paged, "block_hashes", names)
