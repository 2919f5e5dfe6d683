"""What the checkpoint's names form, before anything is decided: the layer graph (which tensors make each
layer, in what order the layers run, and when), the fused expert groups (what a name says of experts:
expert_names.py) and where a layer's experts are, as people read it (expert_map.py), a streamed layer's slot
image, and the templates that layers alike share (alike.py), so that what names decide is worked out once per
kind of layer.

Takes tensor names and sizes (planner.inputs); gives `LayerGraph`, `FusedGroups` and slot layouts.
"""
