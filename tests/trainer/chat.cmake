# data.source = jsonl_chat through the command line (included by CMakeLists.txt inside `if(TARGET ringflex)`): the
# tiny chat example runs as shipped (`ringflex data`, and two training steps at cp 2), and every bad conversation
# fails on every rank before step 1 with one line naming the file, line and field (docs/text.md). The labels
# themselves are checked against transformers in tests/text/chat_labels.py.
set(RF_CHAT_WORK ${RF_TRAIN_WORK}/chat)
set(RF_CHAT_EXAMPLE ${PROJECT_SOURCE_DIR}/examples/gemma4_tiny_chat.yaml)
set(RF_CHAT_DIR ${PROJECT_SOURCE_DIR}/examples/tiny_chat)
# The example names its files relative to the repository's root: the tests run there.
set(RF_CHAT_FILES --set data.tokenizer=${RF_CHAT_DIR}/tokenizer.json
                  --set data.chat_template=${RF_CHAT_DIR}/chat_template.jinja)
file(MAKE_DIRECTORY ${RF_CHAT_WORK})
set(hi "{\"role\": \"assistant\", \"content\": \"hi\"}")
foreach(bad IN ITEMS
    "not_json|{\"messages\": [\n"
    "no_messages|{\"conversation\": []}\n"
    "empty|{\"messages\": []}\n"
    "no_role|{\"messages\": [{\"content\": \"x\"}, ${hi}]}\n"
    "no_content|{\"messages\": [{\"role\": \"user\"}, ${hi}]}\n"
    "bad_role|{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}, ${hi}]}\n"
    "bad_part|{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"file\"}]}, ${hi}]}\n"
    "audio|{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"audio\", \"path\": \"a.wav\"}]}, ${hi}]}\n"
    "no_image|{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image\", \"path\": \"gone.png\"}]}, ${hi}]}\n"
    "bad_image|{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image\", \"path\": \"not_an_image.png\"}]}, ${hi}]}\n"
    "long|{\"messages\": [{\"role\": \"user\", \"content\": \"one two three four five six seven eight nine ten eleven twelve\"}, ${hi}]}\n")
  string(REPLACE "|" ";" parts "${bad}")
  list(GET parts 0 name)
  list(GET parts 1 line)
  string(REPLACE "\\\"" "\"" line "${line}")
  file(WRITE ${RF_CHAT_WORK}/${name}.jsonl "{\"messages\": [{\"role\": \"user\", \"content\": \"ok\"}, ${hi}]}\n${line}")
endforeach()
file(WRITE ${RF_CHAT_WORK}/not_an_image.png "text, not a PNG\n")
file(WRITE ${RF_CHAT_WORK}/bad_template.jinja "{{ bos_token }}{% for m in messages %}{{ m['content'] }\n")

# rf_chat_error(NAME RANKS REGEX ARGS...): `ringflex train` on the tiny chat example with ARGS fails with one
# matching line on each rank.
function(rf_chat_error name ranks regex)
  set(launch ${RF_RINGFLEX})
  if(NOT ranks EQUAL 1)
    set(launch ${RF_MPIEXEC} -n ${ranks} ${RF_RINGFLEX})
  endif()
  add_test(NAME chat_error_${name}
           COMMAND ${RF_EXPECT_ERROR} ${ranks} "${regex}" ${launch} train --config ${RF_CHAT_EXAMPLE} ${RF_CHAT_FILES}
                   --set parallelism.cp=${ranks} --set train.steps=1 ${ARGN}
           WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  set_tests_properties(chat_error_${name} PROPERTIES TIMEOUT 120 ENVIRONMENT "${RF_MPI_ENV}")
endfunction()
set(at ${RF_CHAT_WORK})
rf_chat_error(not_json 2 "${at}/not_json.jsonl:2: not valid JSON" --set data.path=${at}/not_json.jsonl)
rf_chat_error(no_messages 2 "${at}/no_messages.jsonl:2: no `messages`$" --set data.path=${at}/no_messages.jsonl)
rf_chat_error(empty 2 "${at}/empty.jsonl:2: `messages` is empty" --set data.path=${at}/empty.jsonl)
rf_chat_error(no_role 2 "${at}/no_role.jsonl:2: messages\\[0\\]: no `role`$" --set data.path=${at}/no_role.jsonl)
rf_chat_error(no_content 1 "${at}/no_content.jsonl:2: messages\\[0\\]: no `content`$"
              --set data.path=${at}/no_content.jsonl)
rf_chat_error(bad_role 2 "${at}/bad_role.jsonl:2: messages\\[0\\].role = 'robot' is not system, developer, user, assistant or tool$"
              --set data.path=${at}/bad_role.jsonl)
rf_chat_error(bad_part 1 "${at}/bad_part.jsonl:2: messages\\[0\\].content\\[0\\].type = 'file' is not text or image$"
              --set data.path=${at}/bad_part.jsonl)
rf_chat_error(audio 1 "${at}/audio.jsonl:2: messages\\[0\\].content\\[0\\]: audio parts are not supported"
              --set data.path=${at}/audio.jsonl)
rf_chat_error(no_image 2 "${at}/no_image.jsonl:2: messages\\[0\\].content\\[0\\].path: .*gone.png: no such image file$"
              --set data.path=${at}/no_image.jsonl)
rf_chat_error(bad_image 2 "${at}/bad_image.jsonl:2: .*not_an_image.png" --set data.path=${at}/bad_image.jsonl)
# train.samples' prompts with images (docs/train-samples.md): the same files as prompts, refused at setup alike.
rf_chat_error(samples_no_image 2 "${at}/no_image.jsonl:2: messages\\[0\\].content\\[0\\].path: .*gone.png: no such image file$"
              --set train.samples.prompts=${at}/no_image.jsonl)
rf_chat_error(samples_bad_image 2 "${at}/bad_image.jsonl:2: .*not_an_image.png" --set train.samples.prompts=${at}/bad_image.jsonl)
rf_chat_error(bad_template 2 "bad_template.jinja:1:" --set data.chat_template=${at}/bad_template.jinja)
rf_chat_error(overlength 1 "${at}/long.jsonl:2: the conversation has [0-9]+ tokens, longer than a row \\(train.seq_len = 32"
              --set data.path=${at}/long.jsonl --set train.seq_len=32 --set data.chat.overlength=error)

# The example as shipped: what `ringflex data` shows (trained text marked with brackets off a terminal, the
# totals), then two steps of training at cp 2.
add_test(NAME chat_data_example
         COMMAND ${RF_EXPECT_OK} "\\[\\[.*<turn\\|>\\]\\][\\s\\S]*conversations: 30 read, 30 kept, 0 dropped[\\s\\S]*padding"
                 ${RF_RINGFLEX} data --config ${RF_CHAT_EXAMPLE} --show 2
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
add_test(NAME chat_train_example_cp2
         COMMAND ${RF_EXPECT_OK} "step +2"
                 ${RF_MPIEXEC} -n 2 ${RF_RINGFLEX} train --config ${RF_CHAT_EXAMPLE} --set train.steps=2
                 --set checkpoint.dir=${RF_CHAT_WORK}/run --set train.val_every=0
         WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
set_tests_properties(chat_data_example chat_train_example_cp2 PROPERTIES TIMEOUT 300 ENVIRONMENT "${RF_MPI_ENV}")
# The checkpoint it wrote carries the tokenizer and chat template the data was read with (the built-in model has
# none of its own), byte for byte, so `ringflex generate --model` on it reads them.
add_test(NAME chat_example_checkpoint_carries_text_files
         COMMAND sh -c "for f in tokenizer.json tokenizer_config.json chat_template.jinja; do \
                          cmp ${RF_CHAT_DIR}/$f ${RF_CHAT_WORK}/run/step-00000002/$f || exit 1; done")
set_tests_properties(chat_train_example_cp2 PROPERTIES FIXTURES_SETUP chat_example_run)
set_tests_properties(chat_example_checkpoint_carries_text_files PROPERTIES FIXTURES_REQUIRED chat_example_run)

# End to end against transformers: a transformers-made multimodal checkpoint with tokenizer.json and a real Gemma 4
# template, conversations with images, `mpirun -n 2 ringflex train` full and LoRA (chat_train.py says how).
add_test(NAME chat_train_vs_transformers
         COMMAND ${RINGFLEX_PYTHON} ${CMAKE_CURRENT_SOURCE_DIR}/chat_train.py ${RF_RINGFLEX} ${RF_MPIEXEC})
set_tests_properties(chat_train_vs_transformers PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 600 ENVIRONMENT "${RF_MPI_ENV}")
