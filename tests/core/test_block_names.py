"""A prompt's block names and identities computed in one call (blocks.block_identities, and
block_hashes on it) are the values of block_identity and chain_hash block by block, for prompts
given by keyed blocks (whose KV blocks may straddle keyed blocks, or the prompt's own tokens) and
for plain token lists; and a continued naming equals one made at once."""

import pytest

from inferlab.core.blocks import BlockPrompt, block_hashes, block_identities, block_identity, chain_hash


class Source:
    def block_tokens(self, key, length):
        return [(key * 7 + j) % 101 for j in range(length)]

    def own_tokens(self, key, start, end):
        return [(key + j) % 97 for j in range(start, end)]


def one_by_one(tokens, block_size, num_blocks):
    names, identities = [], []
    for i in range(num_blocks):
        identities.append(block_identity(tokens, i * block_size, (i + 1) * block_size))
        names.append(chain_hash(names[-1] if names else 0, identities[-1]))
    return names, identities


@pytest.mark.parametrize("block_size", [4, 8, 6, 16, 12])  # dividing the keyed blocks of 8 or not
def test_names_in_one_call_are_those_block_by_block(block_size):
    prompt = BlockPrompt("ns", [3, 1, 4, 1, 5], 8, 45, own_key=9, source=Source(), id_bound=101)
    tokens = prompt.token_list()
    tokens += [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # outputs after the prompt
    num_blocks = len(tokens) // block_size
    names, identities = one_by_one(tokens, block_size, num_blocks)
    assert block_identities(tokens, block_size, 0, num_blocks) == identities
    assert block_identities(tokens, block_size, 2, num_blocks) == identities[2:]
    assert block_hashes(tokens, block_size, num_blocks) == names
    assert block_hashes(tokens, block_size, num_blocks, block_hashes(tokens, block_size, 3)) == names
    plain = list(tokens)  # the same ids as a list: named by the ids themselves
    plain_names, plain_identities = one_by_one(plain, block_size, num_blocks)
    assert block_identities(plain, block_size, 0, num_blocks) == plain_identities
    assert block_hashes(plain, block_size, num_blocks) == plain_names


@pytest.mark.parametrize("keyed", [True, False])
def test_a_requests_prompt_identities_come_with_its_names(keyed):
    """Request.prompt_block_identities: the identities of the blocks prompt_block_names names, made
    in the same call (the KV manager records and confirms hits by them), also for a request
    unpickled in another process, which comes with its names but without its identities."""
    import pickle

    from inferlab.core.request import Request
    from inferlab.core.sampling_params import SamplingParams

    prompt = BlockPrompt("ns", [3, 1, 4, 1, 5], 8, 45, own_key=9, source=Source(), id_bound=101)
    request = Request(0, prompt if keyed else list(prompt), SamplingParams())
    names, identities = one_by_one(request.token_ids, 4, 45 // 4)
    assert request.prompt_block_names(4) == tuple(names)
    assert request.block_identities == {4: identities}  # made with the names, not again
    assert request.prompt_block_identities(4) == identities
    assert request.prompt_block_identities(8) == one_by_one(request.token_ids, 8, 45 // 8)[1]
    moved = pickle.loads(pickle.dumps(request))
    assert moved.block_identities is None and moved.block_names == request.block_names
    assert moved.prompt_block_identities(4) == identities
