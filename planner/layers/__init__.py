"""What the checkpoint's names form, before anything is decided: the layer graph (which tensors make each
layer, in what order the layers run, and when), the fused expert groups, and a streamed layer's slot image.

Takes tensor names and sizes (planner.inputs); gives `LayerGraph`, `FusedGroups` and slot layouts.
"""
