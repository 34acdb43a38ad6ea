"""The wire: the one communication layer (Axis) that counts bytes per axis, and the replicate exchanges and their codecs."""
