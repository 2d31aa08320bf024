# End-to-end tests of the example inferlets (included from tests/CMakeLists.txt after
# pie_criterion_tests(e2e e2e) created e2e_test_*): each test executable gets the shared
# support code, the folder of the built .wasm files and build dependencies on the inferlets and
# the three services it starts. Plus a check that every inferlet imports only functions that
# sdk/include/pie_abi.h defines.
file(GLOB e2e_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/e2e/test_*.c)
get_property(pie_inferlet_targets GLOBAL PROPERTY PIE_INFERLETS)
foreach(src ${e2e_tests})
  get_filename_component(name ${src} NAME_WE)
  set(exe e2e_${name})
  target_sources(${exe} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/e2e/e2e_support.c)
  target_include_directories(${exe} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/e2e)
  target_compile_definitions(${exe} PRIVATE PIE_INFERLETS_DIR="${PIE_INFERLETS_OUT}")
  target_link_libraries(${exe} PRIVATE m)
  add_dependencies(${exe} ${pie_inferlet_targets} pie-controller pie-worker pie-lifecycle)
  # Five clusters of three services each, under sanitizers on two cores.
  set_tests_properties(e2e/${name} PROPERTIES TIMEOUT 900)
endforeach()

# test_tp.c also runs a fixture of tests/wasm (sec_export: holds a KV page, then waits).
target_compile_definitions(e2e_test_tp PRIVATE PIE_WASM_FIXTURES_DIR="${CMAKE_CURRENT_BINARY_DIR}/wasm")
add_dependencies(e2e_test_tp pie_wasm_fixtures)

find_program(PIE_WASM_OBJDUMP wasm-objdump REQUIRED)
find_program(PIE_SYS_PYTHON3 NAMES python3 PATHS /usr/bin NO_DEFAULT_PATH)
add_test(NAME e2e/inferlets_import_only_the_pie_abi
         COMMAND ${PIE_SYS_PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/e2e/check_imports.py
                 --abi ${CMAKE_SOURCE_DIR}/sdk/include/pie_abi.h --objdump ${PIE_WASM_OBJDUMP}
                 ${PIE_INFERLETS_OUT})
set_tests_properties(e2e/inferlets_import_only_the_pie_abi PROPERTIES LABELS e2e)
