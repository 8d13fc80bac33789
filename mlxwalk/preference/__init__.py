"""Preference training on whole windows: DPO's loss and its exact gradient by the walk."""
