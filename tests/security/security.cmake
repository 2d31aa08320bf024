# Security tests (issue 11; included from tests/CMakeLists.txt after pie_criterion_tests(security
# security) created security_test_*): each starts real services on loopback through the e2e
# tests' support code and uploads fixtures built in tests/wasm (and two example inferlets).
file(GLOB security_tests CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/security/test_*.c)
foreach(src ${security_tests})
  get_filename_component(name ${src} NAME_WE)
  set(exe security_${name})
  target_sources(${exe} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/e2e/e2e_support.c)
  target_include_directories(${exe} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/e2e)
  # PIE_APPS_DIR: the example inferlets (the messaging pair for test_tenants' topics)
  target_compile_definitions(${exe} PRIVATE PIE_INFERLETS_DIR="${CMAKE_CURRENT_BINARY_DIR}/wasm"
                                            PIE_APPS_DIR="${PIE_INFERLETS_OUT}")
  target_link_libraries(${exe} PRIVATE m)
  add_dependencies(${exe} pie_wasm_fixtures pie-controller pie-worker pie-lifecycle
                   inferlet_messaging_producer inferlet_messaging_consumer)
  set_tests_properties(security/${name} PROPERTIES TIMEOUT 900)
endforeach()
