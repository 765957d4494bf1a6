"""Entry points that wire the layers together: train, preprocess, validate, launch."""
