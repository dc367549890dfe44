"""hf_attnscale with other libraries: PEFT fine-tuning and the lm-eval harness (each imported on use)."""
