"""Models: loading (with LoRA/QLoRA), the tokens a recipe adds, sizing, and the memory features."""
