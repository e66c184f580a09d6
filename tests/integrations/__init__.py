"""Flash, finetuning-scheduler and Hugging Face."""
