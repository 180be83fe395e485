"""The Hugging Face Hub: the model card (`card`) and the upload (`push`)."""
