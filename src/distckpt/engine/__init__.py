"""distckpt.engine.blobs"""
