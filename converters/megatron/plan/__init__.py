"""What a Megatron-Core save means and where its bytes go: parameter naming, the save's format and facts
(checked before any work), and the pure plans of `convert` (stored chunk -> logical box) and
`to-megatron` (logical box -> target chunk)."""
