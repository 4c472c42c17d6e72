"""distckpt.wire.frames"""
