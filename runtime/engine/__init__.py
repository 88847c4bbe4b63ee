"""The decode engine: the decoders (one prompt, batched rows), the candidate tree and its masks, acceptance, the KV
cache and its compaction, packed rows, sampling, tree sizing and the acceptance monitor."""
