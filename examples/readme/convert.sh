# Run: bash examples/readme/convert.sh
# (after trainer.py)
set -e
# One torch.save file: Lightning's dict, whole tensors (BoringModel.load_from_checkpoint reads it)
python -m lightning_distckpt convert checkpoints/trainer/last.ckpt checkpoints/model.ckpt
# The module's weights as a Hugging Face directory (or --to dcp, --to megatron)
python -m lightning_distckpt convert checkpoints/trainer/last.ckpt checkpoints/hf --to safetensors
# Back: a torch.save file (a Lightning .ckpt, a state dict) becomes a checkpoint directory
python -m lightning_distckpt convert checkpoints/model.ckpt checkpoints/imported
python -m lightning_distckpt inspect checkpoints/imported  # keys, shapes, shards; `validate` reads it all
