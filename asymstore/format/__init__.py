"""The on-disk format: names, manifests and their parser, checksums, the codec, tensor bytes, placements."""
