"""Training and validation data: synthetic batches or ImageNet-layout folders.

`folders` checks data without torch (the launcher uses it); `loaders` builds what the worker iterates.
"""
