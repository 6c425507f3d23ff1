"""A wrapped layer reports the class name it had, on both frameworks (the ``fw`` fixture,
``tests/support/frameworks.py``), as tools that look layer classes up by name expect
(accelerate's FSDP wrap policies, HF's ``_no_split_modules``, MindSpore's ``cls_name``);
recomp still knows it is wrapped. Those tools themselves are tested in
``tests/integrations/test_name_lookups.py``.
"""

from __future__ import annotations

from recomp._wrapping import recomp_wrapper_of


def test_wrapped_classes_report_the_original_names(fw):
    model = fw.stack(2)
    blocks = fw.blocks(model)
    block_class, attn_class = type(blocks[0]), type(blocks[0].attn)
    attentions = [block.attn for block in blocks]
    fw.api.apply_activation_checkpointing(
        model,
        checkpoint_fn=lambda m: isinstance(m, block_class),
        exclude_fn=lambda m: any(m is attn for attn in attentions),
    )
    block = fw.blocks(model)[0]
    assert recomp_wrapper_of(block) is fw.api.CheckpointWrapper
    assert recomp_wrapper_of(block.attn) is fw.api.ExcludeWrapper
    for layer, base in ((block, block_class), (block.attn, attn_class)):
        assert type(layer) is not base
        assert type(layer).__name__ == fw.class_name(layer) == base.__name__
        assert type(layer).__qualname__ == base.__qualname__
        assert type(layer).__module__ == base.__module__
    names = {type(layer).__name__ for _, layer in fw.named_layers(model)}
    assert block_class.__name__ in names
    assert not any(n.startswith(("Checkpointed", "Excluded")) for n in names)
    # The repr still shows the wrappers.
    text = repr(block)
    assert text.startswith(f"Checkpointed{block_class.__name__}(")
    assert f"(attn): Excluded{attn_class.__name__}(" in text
    # Copies (and, on PyTorch, pickles) stay wrapped and keep the names.
    for clone in fw.copies(model):
        copied = fw.blocks(clone)[1]
        assert recomp_wrapper_of(copied) is fw.api.CheckpointWrapper
        assert recomp_wrapper_of(copied.attn) is fw.api.ExcludeWrapper
        assert type(copied).__name__ == fw.class_name(copied) == block_class.__name__
    fw.api.unwrap(model)
    assert type(fw.blocks(model)[0]) is block_class
    assert type(fw.blocks(model)[0].attn) is attn_class
