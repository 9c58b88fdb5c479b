"""Which node serves what, decided once: consistent hashing with bounded loads (`placement.ring`) and the
prefill-node rule (`placement.prefill`) that the frontend's router applies to every request and a decode
node applies only when its caller named no usable prefill node. Torch-free: the frontend imports it.
"""
