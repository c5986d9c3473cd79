"""Images and audio in prompts: items off the wire (bytes, URLs, paths, processor output, embeddings) -> decoded
`Media`, which a multimodal model's processor turns into a prompt (see `types`)."""
