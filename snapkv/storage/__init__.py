"""The compressed cache in memory and on disk: quantized tiers, deferred restores, the .snapkv file, the store."""
