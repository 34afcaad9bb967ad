"""Text in: documents (text, HTML, PDF in a limited child), needle haystacks, fact documents, streamed text out."""
